"""Tool calls in the chat UI: a call and its result as blocks of their own (arguments
pretty-printed), a tool runs only when the person allows it, and the outcome goes back into the
history in the shape the chat template renders."""

from __future__ import annotations

import json

from textual.app import App, ComposeResult
from textual.widgets import Static

from ferrum_mac.engine.tools import Toolbox, tool
from ferrum_mac.serve import openai_schema as api
from ferrum_mac.text import load_chat_template, load_tokenizer
from ferrum_mac.text.tool_calls import FORMATS, HERMES
from ferrum_mac.tui.screens.tool_permission import ToolPermissionScreen
from ferrum_mac.tui.tool_turn import answer_calls, history_messages, run_allowed
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
