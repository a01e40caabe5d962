"""Reasoning split from the answer: `<think>...</think>` in a stream of text deltas.

Tags may arrive cut across deltas: a tail that could still grow into a tag is held back
until the next delta settles it. Each section (reasoning, answer) comes out stripped of the
whitespace around it, whatever the delta boundaries, so `feed` in any pieces gives the same
text as `feed` of the whole. This is for chat, where the whitespace around a section is
layout (the template's newlines after `</think>`); a reply that is nothing but whitespace is
still a reply and comes out as it is. Raw completions do not go through a splitter at all.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING = "reasoning"
ANSWER = "answer"


@dataclass(frozen=True)
class Delta:
    kind: str  # REASONING or ANSWER
    text: str


def prompt_opens_reasoning(prompt: str, open_tag: str = "<think>", close_tag: str = "</think>") -> bool:
    """Whether a rendered prompt leaves a `<think>` open, so the reply starts inside reasoning
    (templates that force thinking end their generation prompt with '<think>\\n')."""
    opened = prompt.rfind(open_tag)
    return opened >= 0 and prompt.find(close_tag, opened) < 0


class ReasoningSplitter:
    """Feed answer-text deltas; get back `Delta`s of reasoning and answer, in order."""

    def __init__(self, in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>"):
        self.in_reasoning = in_reasoning
        self.open_tag, self.close_tag = open_tag, close_tag
        self._pending = ""  # text that may be the start of the next tag
        self._space = ""  # whitespace held until we know it is not the end of a section
        self._section_start = True
        self._lead = ""  # whitespace before anything was emitted, while no tag has been seen
        self._said_anything = False  # a delta was emitted or a tag was seen

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._pending += text
        while True:
            tag = self.close_tag if self.in_reasoning else self.open_tag
            found = self._pending.find(tag)
            if found < 0:
                keep = _partial_tag_length(self._pending, tag)
                self._emit(self._pending[: len(self._pending) - keep], out)
                self._pending = self._pending[len(self._pending) - keep :]
                return out
            self._emit(self._pending[:found], out)
            self._pending = self._pending[found + len(tag) :]
            self._said_anything = True
            self._end_section()
            self.in_reasoning = not self.in_reasoning

    def finish(self) -> list[Delta]:
        """Flush what was held back (a tag that never completed is plain text). A reply that
        was only whitespace comes out whole rather than as nothing."""
        out: list[Delta] = []
        self._emit(self._pending, out)
        self._pending = ""
        if not self._said_anything and self._lead:
            out.append(Delta(REASONING if self.in_reasoning else ANSWER, self._lead))
            self._said_anything = True
        self._end_section()
        return out

    def _emit(self, text: str, out: list[Delta]) -> None:
        if self._section_start:
            body = text.lstrip()
            if not self._said_anything:
                self._lead += text[: len(text) - len(body)]
            text = body
        if not text:
            return
        self._section_start = False
        self._said_anything = True
        body = text.rstrip()
        if not body:
            self._space += text
            return
        out.append(Delta(REASONING if self.in_reasoning else ANSWER, self._space + body))
        self._space = text[len(body) :]

    def _end_section(self) -> None:
        self._space = ""
        self._section_start = True


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
