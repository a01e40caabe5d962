"""Ask for one line of text (a new title, a file's path: Tab completes it); Enter accepts, Esc cancels."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from ferrum_mac.tui.attachments import complete_path


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


class PathPromptScreen(TextPromptScreen):
    """A path, relative to the working folder; Tab completes it as a shell does."""

    BINDINGS = [Binding("tab", "complete", "Complete", priority=True)]

    def action_complete(self) -> None:
        answer = self.query_one("#answer", Input)
        completed, matches = complete_path(answer.value, Path.cwd())
        if completed != answer.value:
            answer.value = completed
            answer.cursor_position = len(completed)
        elif len(matches) > 1:
            self.notify("  ".join(matches), title="Files", timeout=4)
