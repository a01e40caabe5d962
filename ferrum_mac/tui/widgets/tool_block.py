"""A tool call and its result, each a block of its own in the conversation: the call's name and
its arguments pretty-printed, then what the tool answered (or that it was not run)."""

from __future__ import annotations

import json

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Static

NOT_RUN = "not run: you declined"


def pretty_arguments(arguments: str) -> str:
    """A call's JSON arguments indented for reading; text that is not JSON as it is."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


class ToolCallBlock(Vertical):
    """A call the model made: `call_<id>` name, arguments."""

    def __init__(self, name: str, arguments: str, call_id: str = ""):
        super().__init__(classes="tool-call")
        self.tool_name, self.arguments, self.call_id = name, arguments, call_id

    def compose(self) -> ComposeResult:
        yield Label(f"Tool call: {self.tool_name}", classes="role", markup=False)
        yield Static(pretty_arguments(self.arguments), classes="tool-arguments", markup=False)


class ToolResultBlock(Vertical):
    """What a tool answered; `failed`: its one-line error instead."""

    def __init__(self, name: str, result: str, failed: bool = False):
        super().__init__(classes="tool-result" + (" failed" if failed else ""))
        self.tool_name, self.result, self.failed = name, result, failed

    def compose(self) -> ComposeResult:
        yield Label(
            f"Tool result: {self.tool_name}" + (" (failed)" if self.failed else ""), classes="role", markup=False
        )
        yield Static(self.result, classes="tool-output", markup=False)
