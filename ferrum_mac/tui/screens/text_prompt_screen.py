"""Ask for one line of text (a new title); Enter accepts, Esc cancels."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class TextPromptScreen(ModalScreen[str | None]):
    CSS_PATH = "text_prompt_screen.tcss"
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = ""):
        super().__init__()
        self.question = question
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question)
            yield Input(self.value, id="answer")

    @on(Input.Submitted)
    def _accept(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)
