"""Engine events -> a terminal: the answer to stdout as it comes, reasoning dimmed to stderr,
notices, a line when a limit or the context cut the answer, and the stats line to stderr.
Colour only where the stream is a terminal."""

from __future__ import annotations

import sys
from typing import TextIO

from ferrum_mac.engine import CONTEXT, LOOP, MAX_TOKENS, Done, Event, Notice, ReasoningDelta, TextDelta

DIM, RESET = "\x1b[2m", "\x1b[0m"
CONTEXT_ADVICE = "--kv-capacity sets its size, up to the model's context length"


class EventPrinter:
    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        *,
        show_reasoning: bool = True,
        verbose: bool = False,
    ):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.show_reasoning = show_reasoning
        self.verbose = verbose
        self.limit_setting = "--max-tokens"  # what the user changes the answer limit with
        self.context_advice = CONTEXT_ADVICE  # what to do when the context is full
        self._colour = _is_terminal(self.err)
        self._answer_open = False  # answer text printed without its final newline
        self._reasoning_open = False

    def print(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            self._end_reasoning()
            self._write(self.out, event.text)
            self._answer_open = not event.text.endswith("\n")
        elif isinstance(event, ReasoningDelta):
            if self.show_reasoning:
                self._write(self.err, f"{DIM}{event.text}{RESET}" if self._colour else event.text)
                self._reasoning_open = True
        elif isinstance(event, Notice):
            self.end_line()
            self._write(self.err, f"ferrum: {event.text}\n")
        elif isinstance(event, Done):
            self.end_line()
            cut = cut_line(event, self.limit_setting, self.context_advice)
            if cut:
                self._write(self.err, f"ferrum: {cut}\n")
            if self.verbose:
                self._write(self.err, stats_line(event) + "\n")

    def end_line(self) -> None:
        """Finish a line the answer or the reasoning left open."""
        self._end_reasoning()
        if self._answer_open:
            self._write(self.out, "\n")
            self._answer_open = False

    def _end_reasoning(self) -> None:
        if self._reasoning_open:
            self._write(self.err, "\n\n")
            self._reasoning_open = False

    @staticmethod
    def _write(stream: TextIO, text: str) -> None:
        stream.write(text)
        stream.flush()


def cut_line(done: Done, limit_setting: str, context_advice: str = CONTEXT_ADVICE) -> str | None:
    """Why the answer stopped short, when a limit or the context cut it (and how to change
    that) or it looped (not for its own end)."""
    tokens = f"{done.generated_tokens} token{'s' if done.generated_tokens != 1 else ''}"
    if done.stop_reason == MAX_TOKENS:
        return f"the answer was cut at {tokens} ({limit_setting})"
    if done.stop_reason == CONTEXT:
        return f"the answer was cut at {tokens}: the context is full ({context_advice})"
    if done.stop_reason == LOOP:
        return f"the answer was stopped at {tokens}: it kept repeating itself"
    return None


def stats_line(done: Done) -> str:
    return (
        f"prompt {done.prompt_tokens} tokens ({done.cached_tokens} cached), first token {done.ttft_s:.2f} s, "
        f"prefill {done.prefill_tps:.1f} tok/s; answer {done.generated_tokens} tokens, "
        f"{done.decode_tps:.1f} tok/s; stop: {done.stop_reason}"
    )


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
