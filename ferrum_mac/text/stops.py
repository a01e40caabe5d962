"""Stop strings in a stream of text deltas.

Text that could still be the start of a stop string is held back; at a full match the
stream ends and the stop string itself is never emitted. The result does not depend on
where the deltas were cut: the text before the earliest occurrence of any stop string.
"""

from __future__ import annotations

from typing import Iterable


class StopMatcher:
    """`feed` each delta and emit what it returns; stop generating once `stopped` is set."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._pending += text
        match = self._earliest_match()
        hold = self._earliest_partial()
        if match is not None and (hold is None or hold >= match[0]):
            return self._stop_at(*match)
        cut = len(self._pending) if hold is None else hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def finish(self) -> str:
        """The text still held back, now that no more will come."""
        if self.stopped:
            return ""
        match = self._earliest_match()
        if match is not None:
            return self._stop_at(*match)
        out, self._pending = self._pending, ""
        return out

    def _stop_at(self, position: int, stop: str) -> str:
        out, self._pending = self._pending[:position], ""
        self.stopped, self.matched = True, stop
        return out

    def _earliest_match(self) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        return min(found, default=None, key=lambda m: m[0])

    def _earliest_partial(self) -> int | None:
        """Where the earliest tail that is a proper prefix of some stop string begins."""
        text = self._pending
        for i in range(max(0, len(text) - self._longest + 1), len(text)):
            tail = text[i:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                return i
        return None
