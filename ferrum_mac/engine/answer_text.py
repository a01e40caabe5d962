"""Token ids of an answer -> text events: detokenize, cut at stop strings, split off reasoning.

Stop strings apply to the raw text the model writes (reasoning included), before the
`<think>` split, so a stop string ends the answer wherever it appears. A raw completion
(`raw=True`) is the text exactly as the model wrote it: no reasoning split, no whitespace
trimmed (a prompt `def add(a, b):` continues with its newline and indent).
"""

from __future__ import annotations

from typing import Sequence

from ferrum_mac.engine.events import ReasoningDelta, TextDelta
from ferrum_mac.text import ANSWER, REASONING, Delta, ReasoningSplitter, StopMatcher, StreamingDetokenizer, Tokenizer


class AnswerText:
    """`add` each generated token id, then `finish` once; `answer` and `reasoning` collect the text."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], opens_reasoning: bool, raw: bool = False):
        self.detok = StreamingDetokenizer(tokenizer, keep_start=raw)
        self.stops = StopMatcher(stops)
        self.splitter = None if raw else ReasoningSplitter(opens_reasoning)
        self.answer = ""
        self.reasoning = ""
        self.finished = False

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @property
    def stop_string(self) -> str | None:
        return self.stops.matched

    def add(self, token_id: int) -> list[TextDelta | ReasoningDelta]:
        return self._events(self._split(self.stops.feed(self.detok.add(token_id)), last=False))

    def finish(self) -> list[TextDelta | ReasoningDelta]:
        """What was held back (a partial character, a possible stop string or tag). Idempotent."""
        if self.finished:
            return []
        self.finished = True
        tail = self.stops.feed(self.detok.finish()) + self.stops.finish()
        return self._events(self._split(tail, last=True))

    def _split(self, text: str, last: bool) -> list[Delta]:
        if self.splitter is None:
            return [Delta(ANSWER, text)] if text else []
        return self.splitter.feed(text) + (self.splitter.finish() if last else [])

    def _events(self, deltas) -> list[TextDelta | ReasoningDelta]:
        events: list[TextDelta | ReasoningDelta] = []
        for d in deltas:
            if d.kind == REASONING:
                self.reasoning += d.text
                events.append(ReasoningDelta(d.text))
            else:
                self.answer += d.text
                events.append(TextDelta(d.text))
        return events
