"""An answer's events as every API module sees them, whatever protocol it speaks.

The scheduler emits the engine's `TextDelta` and `ReasoningDelta`, then one `Done` (or serve's
`Failed`). When the request offered tools, `ToolCalls` splits the text into plain text and
`ToolCallDelta`s, so no call markup reaches a client, and the last event becomes a `Finished`:
a `Done` that also says, in neutral words, why the answer ended (`finish`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ferrum_mac.engine import CANCELLED, CONTEXT, MAX_TOKENS, Done, ReasoningDelta, TextDelta
from ferrum_mac.serve.request import Failed
from ferrum_mac.text.tool_calls import StreamingToolParser, ToolCall, ToolCallDelta, ToolFormat, calls_of

# Why an answer ended, in the words the API modules translate into their own.
STOP, LENGTH, TOOL_CALLS = "stop", "length", "tool_calls"
FINISH_CANCELLED = "cancelled"


@dataclass(frozen=True)
class Finished(Done):
    """The last event of an answer that ended well: `Done`'s figures plus `finish`, one of
    STOP, LENGTH, TOOL_CALLS or FINISH_CANCELLED."""

    finish: str = STOP

    @classmethod
    def of(cls, done: Done, called: bool) -> "Finished":
        fields = {k: v for k, v in asdict(done).items() if k in Done.__dataclass_fields__}
        return cls(**fields, finish=TOOL_CALLS if called else finish_of(done))


def finish_of(done: Done) -> str:
    if done.stop_reason in (MAX_TOKENS, CONTEXT):
        return LENGTH
    return FINISH_CANCELLED if done.stop_reason == CANCELLED else STOP


AnswerEvent = TextDelta | ReasoningDelta | ToolCallDelta | Done | Failed


class ToolCalls:
    """Splits an answer's text into text and calls as it arrives, each call's arguments streamed
    as the model writes them (`ToolCallDelta`s). Without a format (no tools) it passes text
    through untouched. `prefix`: what the prompt already opened the answer with (a forced call's
    opener); `parallel` False keeps only the first call."""

    def __init__(self, fmt: ToolFormat | None, parallel: bool = True, prefix: str = ""):
        self.parser = (
            StreamingToolParser(fmt, stream_arguments=True, parallel=parallel, prefix=prefix)
            if fmt is not None
            else None
        )
        self.pieces: list[ToolCallDelta] = []

    @property
    def calls(self) -> list[ToolCall]:
        """The calls so far (the last one's arguments as far as they have come)."""
        return calls_of(self.pieces)

    def feed(self, text: str) -> list[TextDelta | ToolCallDelta]:
        if self.parser is None:
            return [TextDelta(text)] if text else []
        return self._events(self.parser.feed(text))

    def finish(self) -> list[TextDelta | ToolCallDelta]:
        """What the parser held back, once generation has ended."""
        return [] if self.parser is None else self._events(self.parser.finish())

    def _events(self, parsed: list) -> list[TextDelta | ToolCallDelta]:
        out: list[TextDelta | ToolCallDelta] = []
        for item in parsed:
            if isinstance(item, str):
                if item:
                    out.append(TextDelta(item))
            else:
                self.pieces.append(item)
                out.append(item)
        return out
