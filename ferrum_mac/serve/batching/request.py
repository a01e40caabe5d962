"""What a client asks the scheduler for, and the handle it gets back.

A `GenerationRequest` is prompt ids plus settings. `Scheduler.submit` answers with a
`RequestHandle`; the scheduler thread calls the request's `emit` with each event
(TextDelta, ReasoningDelta, then one Done, or one Failed) and the client may `cancel()`
from any thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ferrum_mac.engine import Done, SamplingParams
from ferrum_mac.grammar import GrammarMatcher

_ids = itertools.count(1)


@dataclass(frozen=True)
class Failed:
    """The last event of a request the scheduler could not finish (an error in its forward)."""

    message: str


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    max_tokens: int | None = None  # None: until EOS, a stop string or the end of the context
    stop: tuple[str, ...] = ()
    opens_reasoning: bool = False  # the prompt leaves a <think> open
    logprobs: int | None = None  # None: none; k: each answer token's log-probability and the k likeliest
    raw: bool = False  # a completion: the text exactly as generated (no reasoning split, nothing trimmed)
    ignore_eos: bool = False  # generate max_tokens whatever the model says (for load tests)
    # structured output: the answer's grammar state, used by the scheduler thread only; None: free text
    matcher: GrammarMatcher | None = None
    call_tokens: int | None = None  # the fewest tokens one more required call takes (`AnswerState`)
    speculate: str | None = None  # auto, ngram or off (guess tokens, verify them in one step); None: the server's
    emit: Callable[[object], None] | None = None  # called on the scheduler thread with each event


class RequestHandle:
    def __init__(self, request: GenerationRequest):
        self.request = request
        self.cache_id = f"request-{next(_ids)}"
        self._cancelled = threading.Event()
        self.cached_tokens = 0  # prompt tokens the prefix cache gave (set by the scheduler, final once it prefilled)

    def cancel(self) -> None:
        """Stop generating after the current step and free the request's KV cache."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class EventQueue:
    """A thread-safe sink for `emit` with a blocking iterator over the events (for threads)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()

    def put(self, event) -> None:
        self._queue.put(event)

    def events(self, timeout: float | None = None) -> Iterator[object]:
        """Events until the last one (Done or Failed)."""
        while True:
            event = self._queue.get(timeout=timeout)
            yield event
            if isinstance(event, (Done, Failed)):
                return
