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
    """N-gram matching over the sequence itself: find the most recent earlier place where the
    last n tokens (n = 3, then 2, then 1) occurred and propose what followed them there.

    The index maps each n-gram to the position just after its latest occurrence; it grows
    with the sequence, one token at a time, so a lookup costs the same at any length.
    """

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def peek(self, history: Sequence[int]) -> str | None:
        found = self._match(history)
        return f"ngram{found[0]}" if found else None

    def propose(self, history: Sequence[int], k: int) -> Proposal | None:
        found = self._match(history)
        if found is None or k < 1:
            return None
        n, follows = found
        tokens = list(history[follows : follows + k])
        return Proposal(tokens, f"ngram{n}") if tokens else None

    def close(self) -> None:
        pass

    def _match(self, history: Sequence[int]) -> tuple[int, int] | None:
        """(n, where the continuation starts) for the longest n-gram ending the sequence that
        occurred before, or None."""
        if len(history) < self.indexed:  # a different sequence: start over
            self.index, self.indexed = {}, 0
        self._index_until(history, len(history) - 1)
        for n in range(min(self.max_ngram, len(history) - 1), 0, -1):
            follows = self.index.get(tuple(history[-n:]))
            if follows is not None:
                return n, follows
        return None

    def _index_until(self, history: Sequence[int], end: int) -> None:
        """Index the n-grams ending before position `end` (not the last token's: a match must
        be an earlier occurrence, with something after it)."""
        for stop in range(self.indexed + 1, end + 1):
            for n in range(1, min(self.max_ngram, stop) + 1):
                self.index[tuple(history[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)


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
        self.model.kv_remember(self.cache_id, self.ledger)
        self.model.release(self.cache_id)
        self.ledger = []

    def _catch_up(self, history: Sequence[int]):
        """Bring the draft's cache to `history` and return its logits after the last token."""
        keep = min(common_prefix(self.ledger, history), len(history) - 1)
        if keep < len(self.ledger):
            self.model.truncate_kv(self.cache_id, keep)
        if keep == 0:
            keep = self.model.kv_reuse(self.cache_id, list(history)).tokens
        logits = self.model.prefill(self.cache_id, list(history[keep:]))
        self.ledger = list(history)
        return logits
