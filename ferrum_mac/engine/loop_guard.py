"""Whether an answer has fallen into a loop: the same n-grams over and over in its last tokens.

A small model, and a larger one sampled, can repeat a sentence or a paragraph until the answer's
limit: minutes of a slow machine for nothing. Each answer token ends an n-gram (its last NGRAM
tokens); the answer loops when, of its last WINDOW tokens, at least SHARE end an n-gram that
ended earlier in that window. A loop repeats n-grams nearly all the time, one with a word
changed here and there too; text that repeats itself for a reason does it in shorter runs (a
table's rows differ in their cells, code's lines in their names, a list's items in their
words, a chorus comes back once or twice between verses) and stays far below SHARE over a
window this long.
"""

from __future__ import annotations

from collections import deque

NGRAM = 8  # tokens in each n-gram compared
WINDOW = 320  # the answer's latest tokens judged (a loop runs this long before it is stopped)
SHARE = 0.85  # of them, ending an n-gram seen earlier in the window: a loop


class LoopGuard:
    """`add` each answer token; True once the answer loops."""

    def __init__(self, ngram: int = NGRAM, window: int = WINDOW, share: float = SHARE):
        self.ngram, self.window, self.share = ngram, window, share
        self._recent: deque[int] = deque(maxlen=ngram)
        self._ended: dict[tuple[int, ...], int] = {}  # n-gram -> where it last ended
        self._repeats: deque[bool] = deque()  # for the window's tokens: whether its n-gram is a repeat
        self._count = 0  # of True in _repeats
        self._position = 0

    def add(self, token: int) -> bool:
        self._position += 1
        self._recent.append(token)
        if len(self._recent) < self.ngram:
            return False
        gram = tuple(self._recent)
        last = self._ended.get(gram)
        self._ended[gram] = self._position
        repeated = last is not None and self._position - last < self.window
        self._repeats.append(repeated)
        self._count += repeated
        if len(self._repeats) > self.window:
            self._count -= self._repeats.popleft()
        return len(self._repeats) == self.window and self._count >= self.share * self.window

    def share_now(self) -> float:
        """Of the window's tokens so far, the share that repeat an n-gram (for tuning)."""
        return self._count / len(self._repeats) if self._repeats else 0.0
