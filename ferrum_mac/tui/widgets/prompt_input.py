"""The prompt: Enter sends; Shift+Enter or Ctrl+J inserts a newline."""

from __future__ import annotations

from textual import events
from textual.widgets import TextArea

from ferrum_mac.tui.messages import PromptSubmitted

NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 10; }
    """

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.post_message(PromptSubmitted(text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
