"""A pull's progress as Textual messages posted to a screen (from the pull's worker thread)."""

from __future__ import annotations

from ferrum_mac.store import PullProgress
from ferrum_mac.tui.messages import PullProgressed


class PostedPullProgress(PullProgress):
    def __init__(self, post):
        self.post = post
        self.total = 0
        self.done = 0

    def start(self, title: str, files: list[tuple[str, int, int]]) -> None:
        self.total = sum(size for _, size, _ in files)
        self.done = sum(have for _, _, have in files)
        self.post(PullProgressed(self.done, self.total, title))

    def file_started(self, path: str, size: int, resume_from: int) -> None:
        self.post(PullProgressed(self.done, self.total, path))

    def advance(self, n: int) -> None:
        self.done += n
        self.post(PullProgressed(self.done, self.total))

    def note(self, line: str) -> None:
        self.post(PullProgressed(self.done, self.total, line.strip()))
