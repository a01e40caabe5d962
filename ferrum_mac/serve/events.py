"""An answer's events as every API module sees them, whatever protocol it speaks.

The scheduler emits the engine's `TextDelta` and `ReasoningDelta` (each token's `TokenLogprob`
before its text, when the request asks for them), then one `Done` (or serve's `Failed`). When the request offered tools, the engine's `CallSplitter` splits the text into plain
text and `ToolCallDelta`s, so no call markup reaches a client, and the last event becomes a
`Finished`: a `Done` that also says, in neutral words, why the answer ended (`finish`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ferrum_mac.engine import CANCELLED, CONTEXT, MAX_TOKENS, Done, ReasoningDelta, TextDelta, with_calls
from ferrum_mac.serve.batching.request import Failed
from ferrum_mac.text.tool_calls import ToolCallDelta, calls_of
from ferrum_mac.engine.events import TokenLogprob

__all__ = [
    "LENGTH",
    "STOP",
    "TOOL_CALLS",
    "AnswerEvent",
    "Finished",
    "ToolCallDelta",
    "calls_of",
    "finish_of",
    "logprob_entries",
]

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
        """`called`: the answer holds whole calls; they are its finish only if it ended by
        itself (`with_calls`): one cut by `max_tokens` is LENGTH, calls or not."""
        fields = {k: v for k, v in asdict(done).items() if k in Done.__dataclass_fields__}
        called = with_calls(done.stop_reason, called) == TOOL_CALLS
        return cls(**fields, finish=TOOL_CALLS if called else finish_of(done))


def finish_of(done: Done) -> str:
    """Why `done`'s answer ended, in neutral words (a `Finished` says it itself). A loop stopped
    finishes as "stop" (ferrum's `stats` say "loop"): "length" would ask a client to continue
    the answer, which would loop on."""
    if isinstance(done, Finished):
        return done.finish
    if done.stop_reason in (MAX_TOKENS, CONTEXT):
        return LENGTH
    return FINISH_CANCELLED if done.stop_reason == CANCELLED else STOP


def logprob_entries(tokens: list[TokenLogprob]) -> list[dict]:
    """Tokens' log-probabilities as OpenAI's chat and Ollama both list them: each token, its
    log-probability, its bytes and its likeliest alternatives."""

    def entry(text: str, data: bytes, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(data)}

    return [{**entry(t.text, t.data, t.logprob), "top_logprobs": [entry(*top) for top in t.top]} for t in tokens]


AnswerEvent = TextDelta | ReasoningDelta | ToolCallDelta | TokenLogprob | Done | Failed
