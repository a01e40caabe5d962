"""Tool calls in a chat answer: found in the answer's text, each run only once the person allows
it, and written back into the history the way the chat template and OpenAI's API take them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from ferrum_mac.engine.tools import Toolbox, ToolError
from ferrum_mac.text.tool_calls import ToolCall, ToolFormat, parse_tool_calls
from ferrum_mac.tui.widgets.tool_block import NOT_RUN


@dataclass(frozen=True)
class ToolOutcome:
    call: ToolCall
    result: str
    ran: bool  # False: declined, or it failed (`result` says which)
    failed: bool = False


def answer_calls(answer: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """The answer's text without call markup, and its calls."""
    return parse_tool_calls(answer, fmt)


async def run_allowed(
    calls: list[ToolCall], toolbox: Toolbox, allow: Callable[[ToolCall], Awaitable[bool]]
) -> list[ToolOutcome]:
    """Run each call the person allows (`allow` asks, e.g. with `ToolPermissionScreen`); a
    declined call is not run and its result says so, so the model learns it."""
    outcomes = []
    for call in calls:
        if not await allow(call):
            outcomes.append(ToolOutcome(call, NOT_RUN, ran=False))
            continue
        try:
            outcomes.append(ToolOutcome(call, toolbox.run(call.name, call.arguments), ran=True))
        except ToolError as e:
            outcomes.append(ToolOutcome(call, str(e), ran=False, failed=True))
    return outcomes


def history_messages(content: str, outcomes: list[ToolOutcome]) -> list[dict]:
    """The assistant's message with its calls, then one `tool` message per result."""
    assistant = {"role": "assistant", "content": content, "tool_calls": [o.call.as_openai() for o in outcomes]}
    results = [{"role": "tool", "tool_call_id": o.call.id, "content": o.result} for o in outcomes]
    return [assistant, *results]
