"""Token ids of an answer -> text events: detokenize, cut at stop strings, split off reasoning.

Stop strings apply to the raw text the model writes (reasoning included), before the
`<think>` split, so a stop string ends the answer wherever it appears.
"""

from __future__ import annotations

from typing import Sequence

from ferrum_mac.engine.events import ReasoningDelta, TextDelta
from ferrum_mac.text import REASONING, ReasoningSplitter, StopMatcher, StreamingDetokenizer, Tokenizer


class AnswerText:
    """`add` each generated token id, then `finish` once; `answer` and `reasoning` collect the text."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], opens_reasoning: bool):
        self.detok = StreamingDetokenizer(tokenizer)
        self.stops = StopMatcher(stops)
        self.splitter = ReasoningSplitter(opens_reasoning)
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
        return self._events(self.splitter.feed(self.stops.feed(self.detok.add(token_id))))

    def finish(self) -> list[TextDelta | ReasoningDelta]:
        """What was held back (a partial character, a possible stop string or tag). Idempotent."""
        if self.finished:
            return []
        self.finished = True
        tail = self.stops.feed(self.detok.finish()) + self.stops.finish()
        return self._events(self.splitter.feed(tail) + self.splitter.finish())

    def _events(self, deltas) -> list[TextDelta | ReasoningDelta]:
        events = []
        for d in deltas:
            if d.kind == REASONING:
                self.reasoning += d.text
                events.append(ReasoningDelta(d.text))
            else:
                self.answer += d.text
                events.append(TextDelta(d.text))
        return events
