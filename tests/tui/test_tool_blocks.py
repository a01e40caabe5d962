"""Tool calls in the chat UI: a call and its result as blocks of their own (arguments
pretty-printed), a tool runs only when the person allows it, and the outcome goes back into the
history in the shape the chat template renders."""

from __future__ import annotations

import json

from textual.app import App, ComposeResult
from textual.widgets import Label, Static

from tui_fakes import FakeEngine
from tui_pilot import SIZE, ready, send, wait_for
from ferrum_mac.engine import Done, TextDelta, ToolCallRequested
from ferrum_mac.engine.tools import Toolbox, tool
from ferrum_mac.serve import checks as api
from ferrum_mac.text import load_chat_template, load_tokenizer
from ferrum_mac.text.tool_calls import FORMATS, HERMES, ToolCall
from ferrum_mac.tui import tool_turn
from ferrum_mac.tui.screens.tool_permission import ToolPermissionScreen
from ferrum_mac.tui.tool_turn import answer_calls, history_messages, run_allowed
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.tool_block import NOT_RUN, ToolCallBlock, ToolResultBlock

ANSWER = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "wipe_disk", "arguments": {}}\n</tool_call>'
)
runs: list[str] = []


@tool
def get_weather(city: str, days: list[int]) -> str:
    """The weather in a city."""
    runs.append(city)
    return f"sunny in {city}"


@tool
def wipe_disk() -> str:
    """Do not."""
    runs.append("wipe")
    return "wiped"


class Blocks(App):
    def __init__(self, widgets):
        super().__init__()
        self.widgets = widgets

    def compose(self) -> ComposeResult:
        yield from self.widgets


async def test_call_and_result_are_blocks_with_pretty_arguments():
    app = Blocks(
        [ToolCallBlock("get_weather", '{"city": "Paris", "days": [1, 2]}'), ToolResultBlock("get_weather", "sunny")]
    )
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        texts = [str(s.render()) for s in app.query(Static)]
        assert "Tool call: get_weather" in texts and "Tool result: get_weather" in texts
        assert json.dumps({"city": "Paris", "days": [1, 2]}, indent=2) in texts


async def test_only_allowed_tools_run_and_the_history_renders(shared_assets):
    content, calls = answer_calls(ANSWER, FORMATS[HERMES])
    assert content == "Checking.\n" and [c.name for c in calls] == ["get_weather", "wipe_disk"]
    app = Blocks([])
    async with app.run_test(size=(80, 24)) as pilot:
        answers = iter(["y", "n"])

        async def allow(call):
            screen = ToolPermissionScreen(call.name, call.arguments)
            waiter = app.push_screen_wait(screen)
            return await _answered(pilot, waiter, next(answers))

        runs.clear()
        outcomes = await _in_worker(app, run_allowed(calls, Toolbox([get_weather, wipe_disk]), allow))
    assert runs == ["Paris"]  # wipe_disk was declined, so it never ran
    assert [(o.ran, o.result) for o in outcomes] == [(True, "sunny in Paris"), (False, NOT_RUN)]
    history = [{"role": "user", "content": "Weather?"}, *history_messages(content, outcomes)]
    checked = api.chat_messages({"messages": history})  # what the server would accept back
    template = load_chat_template(shared_assets / "stories260K", load_tokenizer(shared_assets / "stories260K"))
    prompt = template.render(checked, tools=Toolbox([get_weather, wipe_disk]).definitions())
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in prompt and NOT_RUN in prompt


async def _in_worker(app, coroutine):
    worker = app.run_worker(coroutine)
    return await worker.wait()


async def _answered(pilot, waiter, key: str):
    import asyncio

    task = asyncio.ensure_future(waiter)
    await pilot.pause()
    assert isinstance(pilot.app.screen, ToolPermissionScreen)
    await pilot.press(key)
    return await task


# -- the chat app running tools live, on a scripted engine -------------------------------------


class ToolEngine(FakeEngine):
    """Calls get_weather when offered tools, then answers with what the tool returned."""

    def __init__(self):
        super().__init__()
        self.offered: list = []  # the tools each turn was offered (None: none)

    def send(self, conv, text, cancel=None, response_format=None, tools=None):
        self.offered.append(tools)
        if tools is None:
            yield from super().send(conv, text, cancel, response_format)
            return
        if text is not None:
            conv.messages.append({"role": "user", "content": text})
            call = ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')
            conv.messages.append({"role": "assistant", "content": "Let me check.", "tool_calls": [call.as_openai()]})
            yield TextDelta("Let me check.")
            yield ToolCallRequested((call,))
        else:
            self.turns.append({"history": list(conv.messages), "text": None})
            result = conv.messages[-1]["content"]
            conv.messages.append({"role": "assistant", "content": f"The tool says: {result}"})
            yield TextDelta(f"The tool says: {result}")
        conv.ledger = list(range(10 * len(conv.messages)))
        yield Done("tool_calls" if text else "eos", 12, 0, 3, 0.25, 48.0, 42.0)


async def _answered_by_tool(pilot, key: str) -> None:
    screen = pilot.app.chat
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ToolPermissionScreen), what="the permission screen")
    assert "get_weather" in str(pilot.app.screen.query_one(Label).render())
    await pilot.press(key)
    await wait_for(
        pilot,
        lambda: not screen.busy and len(screen.query(ToolResultBlock)) == len(screen.query(ToolCallBlock)),
        what="the tool's result and the answer",
    )
    await wait_for(pilot, lambda: not screen.busy, what="the answer after the tool")
    await pilot.pause()


async def test_the_app_asks_runs_the_tool_and_answers_with_its_result(make_app, history, monkeypatch):
    monkeypatch.setattr(tool_turn, "_registered", Toolbox([get_weather, wipe_disk]))
    engine = ToolEngine()
    app = make_app(engine=engine)
    runs.clear()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Weather in Paris?")
        await _answered_by_tool(pilot, "y")
        screen = app.chat
        [block] = screen.query(ToolCallBlock)
        assert json.dumps({"city": "Paris", "days": [1, 2]}, indent=2) in str(
            block.query_one(".tool-arguments", Static).render()
        )
        assert [str(r.query_one(".tool-output", Static).render()) for r in screen.query(ToolResultBlock)] == [
            "sunny in Paris"
        ]
        answers = [v.content for v in screen.query(MessageView) if v.role == "assistant"]
        assert answers == ["Let me check.", "The tool says: sunny in Paris"]
        await send(pilot, "And now?")
        await _answered_by_tool(pilot, "n")
        assert str(screen.query(ToolResultBlock)[-1].query_one(".tool-output", Static).render()) == NOT_RUN
    assert runs == ["Paris"]  # the declined call never ran
    chat_id = history.conversations()[0].id
    roles = [m.role for m in history.messages(chat_id)]
    assert roles == ["user", "assistant", "tool_call", "tool", "assistant"] * 2
    seen = engine.turns[0]["history"]  # what the model read before answering the first result
    assert seen[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert seen[-1] == {"role": "tool", "tool_call_id": seen[-2]["tool_calls"][0]["id"], "content": "sunny in Paris"}
    assert api.chat_messages({"messages": seen})  # the shape the server takes too
    assert all(t is not None for t in engine.offered)


async def test_without_registered_tools_nothing_is_offered(make_app, monkeypatch):
    monkeypatch.setattr(tool_turn, "_registered", Toolbox())
    engine = ToolEngine()
    app = make_app(engine=engine)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Hello")
        assert not app.chat.query(ToolCallBlock)
    assert engine.offered == [None] and tool_turn.registered_tools() is None


def test_register_tool_keeps_the_function():
    box = Toolbox()
    original = tool_turn._registered
    try:
        tool_turn._registered = box

        @tool_turn.register_tool(description="Shout it")
        def shout(text: str) -> str:
            return text.upper()

        assert shout("a") == "A" and tool_turn.registered_tools() is box
        assert box.definitions()[0]["function"]["description"] == "Shout it"
    finally:
        tool_turn._registered = original
