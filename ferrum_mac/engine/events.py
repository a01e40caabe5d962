"""What a turn yields while it runs: text as it comes, notices, the tool calls it made, and one `Done` at the end."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Union

from ferrum_mac.text.tool_calls import ToolCall

# Why an answer ended.
EOS = "eos"  # the model's end-of-sequence token
STOP_STRING = "stop"  # one of the stop strings
MAX_TOKENS = "max_tokens"  # the answer reached max_tokens
CANCELLED = "cancelled"  # the cancel event or Ctrl-C
CONTEXT = "context"  # the KV cache is full
TOOL_CALLS = "tool_calls"  # the answer called tools and waits for their results
LOOP = "loop"  # the answer kept repeating itself (`loop_guard`)


@dataclass(frozen=True)
class TextDelta:
    """More of the answer."""

    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability, before the text it adds (only for a request that asks).

    The model's own distribution: log_softmax of its logits, before the request's temperature,
    penalties, bias, top-k/top-p or grammar (as vLLM reports by default, and as OpenAI's do not
    change with temperature). `top`: the likeliest tokens at that step, most likely first, as
    (text, bytes, logprob). A token's text is its bytes as UTF-8 (a partial character escaped)."""

    text: str
    data: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """More of the model's reasoning (the `<think>` section)."""

    text: str


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not the answer (e.g. old turns were dropped)."""

    text: str


@dataclass(frozen=True)
class ToolCallRequested:
    """The answer called tools (just before its `Done`): run them, or not, and hand the results
    to `Conversation.add_tool_results`; `Conversation.continue_answer` then lets the model answer."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class Done:
    """The last event of a turn, with its figures."""

    stop_reason: str
    prompt_tokens: int  # prefilled for this turn
    cached_tokens: int  # reused from the KV cache instead of prefilled
    generated_tokens: int
    ttft_s: float  # turn start to the first answer token
    prefill_tps: float  # prompt_tokens / ttft_s
    decode_tps: float  # tokens after the first / time after the first
    stop_string: str | None = None
    speculation: dict | None = None  # {proposed, accepted, steps}; None: the answer did not speculate

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


Event = Union[TextDelta, ReasoningDelta, Notice, ToolCallRequested, Done, TokenLogprob]
