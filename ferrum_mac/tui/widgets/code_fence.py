"""A highlighted code block with a "copy" label in its corner."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.widgets import Label
from textual.widgets.markdown import MarkdownFence

from ferrum_mac.tui.messages import CopyRequested


class CodeFence(MarkdownFence):
    DEFAULT_CSS = """
    CodeFence { layers: code copy; }
    CodeFence > #code-content { layer: code; }
    CodeFence > .copy {
        layer: copy; dock: right; width: auto; height: 1; padding: 0 1;
        color: $text-muted; background: $boost;
    }
    CodeFence > .copy:hover { color: $text; background: $accent 40%; }
    """

    def compose(self) -> ComposeResult:
        yield from super().compose()
        yield Label("copy", classes="copy")

    def on_click(self, event: events.Click) -> None:
        if event.widget is not None and event.widget.has_class("copy"):
            event.stop()
            self.post_message(CopyRequested(self.code, "code block"))
