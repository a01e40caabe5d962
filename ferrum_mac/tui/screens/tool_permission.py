"""Asks before a tool runs: the model may call a tool, only the person may run it.
y or Enter on "Run" runs it; n, Esc or "Don't run" declines."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from ferrum_mac.tui.widgets.tool_block import pretty_arguments


class ToolPermissionScreen(ModalScreen[bool]):
    DEFAULT_CSS = """
    ToolPermissionScreen { align: center middle; }
    ToolPermissionScreen #dialog { width: 70; height: auto; border: round $warning; background: $surface; padding: 1 2; }
    ToolPermissionScreen #buttons { height: auto; margin-top: 1; align-horizontal: right; }
    ToolPermissionScreen #buttons > Button { margin-left: 1; }
    """
    BINDINGS = [Binding("y", "dismiss(True)", "Run"), Binding("n,escape", "dismiss(False)", "Don't run")]

    def __init__(self, name: str, arguments: str):
        super().__init__()
        self.tool_name, self.arguments = name, arguments

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"The model wants to run the tool '{self.tool_name}' with:", markup=False)
            yield Static(pretty_arguments(self.arguments), markup=False, id="arguments")
            with Horizontal(id="buttons"):
                yield Button("Run", variant="warning", id="yes")
                yield Button("Don't run", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # running is never the default

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")
