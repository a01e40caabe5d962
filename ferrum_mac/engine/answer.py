"""One answer token by token: its text events, tool calls split from its text, why it ended, its figures.

The chat engine's loop (`turn.run_turn`) and the server's scheduler hand each drawn token to
an `AnswerState`, which applies the rules every answer keeps:

- an end-of-sequence token ends the answer and writes no text (unless `ignore_eos`, which a
  finished grammar still overrides);
- a grammar that allows nothing more ends it (EOS), before a stop string or the limit;
- then a stop string (STOP_STRING), then `max_tokens` (MAX_TOKENS), then a loop: the answer
  repeating itself over and over (LOOP, `loop_guard`; not with `ignore_eos`, whose caller wants
  every token it asked for); the caller, which knows the cache, ends it when the context is
  full (CONTEXT) or it is cancelled (CANCELLED);
- an answer that must call tools ends (EOS) once its calls are whole and what is left of
  `max_tokens` cannot hold another call (`call_tokens`), so the limit never cuts a call it
  could have left out.

`CallSplitter` takes the call markup out of the text as it streams, and `done_event` turns an
answer's counts and times into its `Done` (the remote client builds its own the same way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ferrum_mac.engine.answer_text import AnswerText
from ferrum_mac.engine.events import EOS, LOOP, MAX_TOKENS, STOP_STRING, TOOL_CALLS, Done, ReasoningDelta, TextDelta
from ferrum_mac.engine.loop_guard import LoopGuard
from ferrum_mac.grammar import GrammarMatcher
from ferrum_mac.text.tool_calls import StreamingToolParser, ToolCall, ToolCallDelta, ToolFormat, calls_of


@dataclass
class Timing:
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None

    def token(self) -> None:
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last


class AnswerState:
    """`add` each drawn token: its text events come back, and `reason` is set once the token
    ends the answer. `matcher`: the answer's grammar, which `add` feeds the token to unless the
    caller's loop already has (`accepted`)."""

    def __init__(
        self,
        text: AnswerText,
        eos_ids: Iterable[int],
        *,
        matcher: GrammarMatcher | None = None,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        timing: Timing | None = None,
        call_tokens: int | None = None,
    ):
        self.text = text
        self.call_tokens = call_tokens  # the fewest tokens one more required call takes (`another_call_tokens`)
        self.eos_ids = frozenset(eos_ids)
        self.matcher = matcher
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.timing = timing or Timing()
        self.generated = 0
        self.reason: str | None = None  # why the answer ended; None while it goes on
        self.loops = None if ignore_eos else LoopGuard()

    def add(self, token: int, accepted: bool = False) -> list[TextDelta | ReasoningDelta]:
        self.timing.token()
        self.generated += 1
        matcher = self.matcher
        if matcher is not None and not accepted:
            matcher.accept(token)
        finished = matcher is not None and matcher.is_finished()  # the grammar allows nothing more
        if token in self.eos_ids and (finished or not self.ignore_eos):
            self.reason = EOS
            return []
        events = self.text.add(token)
        looping = self.loops is not None and self.loops.add(token)
        if finished:
            self.reason = EOS
        elif self.text.stopped:
            self.reason = STOP_STRING
        elif self._no_room_for_another_call():
            self.reason = EOS
        elif self.generated == self.max_tokens:
            self.reason = MAX_TOKENS
        elif looping:
            self.reason = LOOP
        return events

    def _no_room_for_another_call(self) -> bool:
        """Whether a required answer whose calls are whole (its grammar could end here) has less
        of `max_tokens` left than one more call takes: it ends, rather than start a call that
        the limit would cut."""
        if self.call_tokens is None or self.max_tokens is None or self.matcher is None:
            return False
        return self.max_tokens - self.generated < self.call_tokens and self.matcher.is_complete()

    def finish(self) -> list[TextDelta | ReasoningDelta]:
        """What the text held back (a partial character, a possible stop string). Idempotent."""
        return self.text.finish()

    def done(self, reason: str, prompt: int, cached: int, speculation=None) -> Done:
        """The answer's `Done`: `prompt` tokens prefilled, `cached` taken from the cache."""
        return done_event(reason, prompt, cached, self.generated, self.timing, self.text.stop_string, speculation)


def with_calls(reason: str, called: bool) -> str:
    """Why an answer that made calls ended: an answer that ended by itself waits for their
    results; one cut short (`max_tokens`, the context) stays cut, whatever whole calls it holds."""
    return TOOL_CALLS if called and reason == EOS else reason


class CallSplitter:
    """An answer's text split into text and tool calls as it streams; without a format (no
    tools) the text passes through. `prefix`: what the prompt already opened the answer with (a
    forced call's opener); `parallel` False keeps only the first call; `stream_arguments`: each
    call comes in pieces (`ToolCallDelta`s) as the model writes its arguments, else whole
    (`ToolCall`s) once it is closed."""

    def __init__(self, fmt: ToolFormat | None, parallel: bool = True, prefix: str = "", stream_arguments: bool = False):
        self.parser = (
            StreamingToolParser(fmt, stream_arguments=stream_arguments, parallel=parallel, prefix=prefix)
            if fmt is not None
            else None
        )
        self.text = ""  # the answer's text without call markup
        self.pieces: list[ToolCall | ToolCallDelta] = []

    @property
    def calls(self) -> list[ToolCall]:
        """The whole calls so far (a streamed one once its arguments are a whole object)."""
        whole = [p for p in self.pieces if isinstance(p, ToolCall)]
        return whole + calls_of([p for p in self.pieces if isinstance(p, ToolCallDelta)])

    def feed(self, text: str) -> list[TextDelta | ToolCall | ToolCallDelta]:
        if self.parser is None:
            self.text += text
            return [TextDelta(text)] if text else []
        return self._events(self.parser.feed(text))

    def split(
        self, events: Sequence[TextDelta | ReasoningDelta]
    ) -> list[TextDelta | ReasoningDelta | ToolCall | ToolCallDelta]:
        """`feed` each text event's text; reasoning passes through."""
        out: list[TextDelta | ReasoningDelta | ToolCall | ToolCallDelta] = []
        for event in events:
            out.extend(self.feed(event.text) if isinstance(event, TextDelta) else [event])
        return out

    def finish(self, reason: str = EOS) -> list[TextDelta | ToolCall | ToolCallDelta]:
        """What the parser held back, once generation has ended for `reason` (then nothing
        more). An answer that did not end by itself (EOS) may have cut a call short: what it
        wrote of that call is neither text nor a call (`calls` holds whole calls only)."""
        if self.parser is None:
            return []
        parser, self.parser = self.parser, None
        return self._events(parser.finish(cut=reason != EOS))

    def _events(self, parsed: list) -> list[TextDelta | ToolCall | ToolCallDelta]:
        out: list[TextDelta | ToolCall | ToolCallDelta] = []
        for item in parsed:
            if isinstance(item, str):
                if item:
                    self.text += item
                    out.append(TextDelta(item))
            else:
                self.pieces.append(item)
                out.append(item)
        return out


def done_event(
    reason: str, prompt: int, cached: int, generated: int, timing: Timing, stop: str | None, speculation=None
) -> Done:
    """`speculation`: the answer's `SpeculationStats` (None: it did not speculate)."""
    first = timing.first if timing.first is not None else time.perf_counter()
    ttft = first - timing.start
    decode_time = (timing.last or first) - first
    return Done(
        stop_reason=reason,
        prompt_tokens=prompt,
        cached_tokens=cached,
        generated_tokens=generated,
        ttft_s=ttft,
        prefill_tps=prompt / ttft if ttft > 0 else 0.0,
        decode_tps=(generated - 1) / decode_time if generated > 1 and decode_time > 0 else 0.0,
        stop_string=stop,
        speculation=speculation.as_dict() if speculation is not None else None,
    )
