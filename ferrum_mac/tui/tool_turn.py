"""Tool calls in the chat app: Python functions registered as tools, offered to the model with
every message; each call it makes is shown as a block, run only once the person allows it, its
result shown and written back, and then the model answers with the results.

    from ferrum_mac.tui.tool_turn import register_tool

    @register_tool
    def get_weather(city: str) -> str:
        \"\"\"The current weather in a city.\"\"\"
        return f"sunny in {city}"

then start the app from that script (`ferrum_mac.tui.app.main`). With no tools registered
nothing changes: the model is offered none.

In the history a call is a row of its own (role "tool_call": the arguments, with the call's id
and name in its stats) after the answer that made it, and a result too (role "tool": what the
tool answered); `engine_messages` turns them back into the `tool_calls` and `tool` messages of
OpenAI's shape, which the chat template renders.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from textual.message import Message

from ferrum_mac.engine.tools import Toolbox, ToolError, tool
from ferrum_mac.text.tool_calls import ToolCall, ToolFormat, parse_tool_calls
from ferrum_mac.tui.widgets.tool_block import NOT_RUN, ToolCallBlock, ToolResultBlock

CALL_ROLE, RESULT_ROLE = "tool_call", "tool"
TOOL_ROLES = (CALL_ROLE, RESULT_ROLE)

_registered = Toolbox()


def register_tool(function: Callable[..., Any] | None = None, **options):
    """Offer `function` to the model in the chat app (also a decorator; `options` as
    `engine.tools.tool`: name, description, parameters). Returns the function unchanged."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _registered.register(tool(fn, **options) if options else fn)
        return fn

    return register if function is None else register(function)


def registered_tools() -> Toolbox | None:
    """The tools registered so far; None when there are none (the model is offered nothing)."""
    return _registered if len(_registered) else None


class ToolCallsRequested(Message):
    """The answer being streamed called tools (its Done follows)."""

    def __init__(self, calls: tuple[ToolCall, ...]):
        super().__init__()
        self.calls = calls


def answer_events(conv, text: str | None, cancel, tools: Toolbox | None):
    """The engine's events for the next answer: to `text`, or (`text` None) to the tool results
    the conversation ends with. Without tools the call is the one the app always made."""
    if text is None:
        return conv.continue_answer(cancel, tools=tools)
    return conv.send(text, cancel, tools=tools) if tools is not None else conv.send(text, cancel)


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
    calls: list[ToolCall] | tuple[ToolCall, ...], toolbox: Toolbox, allow: Callable[[ToolCall], Awaitable[bool]]
) -> list[ToolOutcome]:
    """Run each call the person allows (`allow` asks, e.g. with `ToolPermissionScreen`), in a
    thread so a slow tool never freezes the app; a declined call is not run and its result says
    so, so the model learns it."""
    outcomes = []
    for call in calls:
        if not await allow(call):
            outcomes.append(ToolOutcome(call, NOT_RUN, ran=False))
            continue
        try:
            result = await asyncio.to_thread(toolbox.run, call.name, call.arguments)
            outcomes.append(ToolOutcome(call, result, ran=True))
        except ToolError as e:
            outcomes.append(ToolOutcome(call, str(e), ran=False, failed=True))
    return outcomes


def history_messages(content: str, outcomes: list[ToolOutcome]) -> list[dict]:
    """The assistant's message with its calls, then one `tool` message per result."""
    assistant = {"role": "assistant", "content": content, "tool_calls": [o.call.as_openai() for o in outcomes]}
    results = [{"role": "tool", "tool_call_id": o.call.id, "content": o.result} for o in outcomes]
    return [assistant, *results]


# -- the history's rows ------------------------------------------------------------------------


def call_row(call: ToolCall) -> tuple[str, str, dict]:
    """(role, content, stats) of the row that records `call`."""
    return CALL_ROLE, call.arguments, {"tool_call_id": call.id, "name": call.name}


def result_row(outcome: ToolOutcome) -> tuple[str, str, dict]:
    stats = {"tool_call_id": outcome.call.id, "name": outcome.call.name, "failed": outcome.failed}
    return RESULT_ROLE, outcome.result, stats


def tool_widget(stored):
    """The block a stored call or result row is shown as."""
    name = stored.stats.get("name", "")
    if stored.role == CALL_ROLE:
        return ToolCallBlock(name, stored.content, stored.stats.get("tool_call_id", ""))
    return ToolResultBlock(name, stored.content, failed=bool(stored.stats.get("failed")))


def add_tool_row(messages: list[dict], stored) -> None:
    """Add a stored call or result row to the engine's `messages`: a call joins the assistant
    message before it (its `tool_calls`), a result is a `tool` message."""
    call_id = stored.stats.get("tool_call_id", "")
    if stored.role == RESULT_ROLE:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": stored.content})
        return
    if not messages or messages[-1].get("role") != "assistant":
        messages.append({"role": "assistant", "content": ""})
    call = ToolCall(stored.stats.get("name", ""), stored.content, call_id)
    messages[-1].setdefault("tool_calls", []).append(call.as_openai())


async def handle_calls(screen, calls: tuple[ToolCall, ...], toolbox: Toolbox) -> None:
    """The tool flow after an answer that called tools: each call's block, the permission
    screen for it, its result's block, every row saved, then the model's next answer."""
    from ferrum_mac.tui.screens.tool_permission import ToolPermissionScreen
    from ferrum_mac.tui.widgets.message_list import MessageList

    shown = screen.query_one(MessageList)
    history, chat_id = screen.history, screen.current_id
    for call in calls:
        history.add_message(chat_id, *call_row(call)[:2], stats=call_row(call)[2])
        await shown.add(ToolCallBlock(call.name, call.arguments, call.id))

    async def allow(call: ToolCall) -> bool:
        return bool(await screen.app.push_screen_wait(ToolPermissionScreen(call.name, call.arguments)))

    for outcome in await run_allowed(calls, toolbox, allow):
        role, content, stats = result_row(outcome)
        history.add_message(chat_id, role, content, stats=stats)
        await shown.add(ToolResultBlock(outcome.call.name, content, failed=outcome.failed))
    await screen.answers.continue_after_tools()
