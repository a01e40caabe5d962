"""A compiled grammar and the per-sequence matcher that turns it into each step's token bitmask.

Compiling a grammar against a vocabulary is the costly part (milliseconds for a small schema,
seconds for a big one): `compile_grammar` keeps the last grammars each vocabulary compiled (and
the errors of those it could not), so a schema sent again, as agents resend their tools every
step, costs nothing. Each answer's matcher is a copy of the compiled grammar at its start.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import llguidance
import numpy as np

from ferrum_mac.grammar.schema import GrammarError, grammar_error, one_line
from ferrum_mac.grammar.lru import SizedLru
from ferrum_mac.grammar.tokens import GrammarVocab

CACHED_GRAMMARS = 64  # per vocabulary; a compiled grammar holds its lexer (up to megabytes)
CACHED_BYTES = 64 * 2**20  # of grammar text, per vocabulary


@dataclass(frozen=True, eq=False)
class Grammar:
    """A grammar compiled against one model's vocabulary; matchers for many sequences copy it."""

    text: str
    vocab: GrammarVocab
    compiled: llguidance.LLMatcher = field(repr=False)  # at the grammar's start; never advanced


@dataclass
class CompileStats:
    """What compiling grammars in this process has cost: for `/metrics`."""

    compiled: int = 0
    cached: int = 0
    failed: int = 0
    seconds: float = 0.0


STATS = CompileStats()


def compile_grammar(grammar: str, vocab: GrammarVocab, what: str = "the grammar") -> Grammar:
    """`grammar` (from `schema`) compiled against `vocab`, or the one compiled before; a grammar
    the engine rejects is a `GrammarError` naming `what`."""
    cache = _cache_of(vocab)
    found = cache.get(grammar)
    if found is not None:
        STATS.cached += 1
        if isinstance(found, GrammarError):
            raise found.with_traceback(None)
        return found
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(vocab.engine_tokenizer, grammar, log_level=0)
    STATS.seconds += time.perf_counter() - start
    if matcher.is_error():
        STATS.failed += 1
        error = grammar_error(matcher.get_error(), what)
        cache.put(grammar, error, len(grammar))
        raise error
    STATS.compiled += 1
    compiled = Grammar(grammar, vocab, matcher)
    cache.put(grammar, compiled, len(grammar))
    return compiled


_caches: "weakref.WeakKeyDictionary[GrammarVocab, SizedLru]" = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()  # the server compiles on worker threads


def _cache_of(vocab: GrammarVocab) -> SizedLru:
    with _caches_lock:
        cache = _caches.get(vocab)
        if cache is None:
            cache = _caches[vocab] = SizedLru(CACHED_GRAMMARS, CACHED_BYTES)
        return cache


class GrammarMatcher:
    """One sequence's place in a grammar.

    `start_after`: token ids that must appear (as a run) before the grammar begins, e.g. the ids
    of `</think>`, so a thinking model reasons freely and only its answer is constrained. Until
    then every id of the tokenizer is allowed (the reasoning may use special tokens). Once the grammar is complete only the model's EOS ids are.
    """

    def __init__(self, grammar: Grammar, start_after: Sequence[int] = ()):
        self.vocab = grammar.vocab
        self._matcher = grammar.compiled.deep_copy()
        self._start_after = tuple(start_after)
        self._seen: list[int] = []  # recent tokens while waiting for `start_after`
        self._started = not self._start_after

    @property
    def started(self) -> bool:
        """Whether the grammar constrains the next token (the `start_after` prefix has been seen)."""
        return self._started

    def fill_mask(self, out: np.ndarray, row: int = 0) -> None:
        """Write the allowed ids into `out[row]` (int32 words, `vocab.words` per row)."""
        target = out[row]
        if target.shape != (self.vocab.words,) or target.dtype != np.int32 or not target.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a mask row must be {self.vocab.words} contiguous int32 words")
        if not self._started:
            target[:] = self.vocab.free_mask
            return
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def accept(self, token_id: int) -> None:
        """Advance past the sampled `token_id`; one the mask did not allow is a `GrammarError`."""
        if not self._started:
            self._seen.append(token_id)
            del self._seen[: -len(self._start_after)]
            self._started = tuple(self._seen) == self._start_after
            return
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not fit the grammar: {one_line(self._matcher.get_error())}")

    def is_finished(self) -> bool:
        """Whether the grammar is complete and EOS has been accepted (or nothing else could follow)."""
        return self._started and self._matcher.is_stopped()

    def is_complete(self) -> bool:
        """Whether the text so far is a whole match (EOS would be accepted now)."""
        return self._started and self._matcher.is_accepting()

    def rollback(self, count: int) -> None:
        """Take back the last `count` accepted tokens of the grammar (not of a `start_after` prefix)."""
        if count and not self._matcher.rollback(count):
            raise GrammarError(f"cannot roll a grammar back {count} tokens: {one_line(self._matcher.get_error())}")


_executor: llguidance.LLExecutor | None = None


def fill_masks(rows: Sequence[tuple[GrammarMatcher, int]], out: np.ndarray) -> None:
    """`fill_mask` for a batch step: each `(matcher, row)` fills `out[row]`, the grammars' rows
    computed in parallel on the engine's threads. Rows not named are left as they are (a row
    without a grammar: `full_mask`)."""
    global _executor
    if not rows:
        return
    words = rows[0][0].vocab.words
    if out.ndim != 2 or out.shape[1] != words or out.dtype != np.int32 or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"a batch mask must be (rows, {words}) contiguous int32 words")
    started = []
    for matcher, row in rows:
        if not 0 <= row < out.shape[0]:
            raise ValueError(f"row {row} is outside a batch mask of {out.shape[0]} rows")
        if matcher.started:
            started.append((matcher._matcher, row))
        else:
            out[row] = matcher.vocab.free_mask
    if started:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr(started, out.ctypes.data, out.strides[0], out.shape[0])
