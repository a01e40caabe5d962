"""The prompt: Enter sends; Shift+Enter or Ctrl+J inserts a newline.

A paste of more than PASTE_LINES lines becomes an attachment (a chip above the prompt) instead of
filling it; Tab after `@` completes a file path; Backspace in an empty prompt drops the last
attachment.
"""

from __future__ import annotations

from pathlib import Path

from textual import events
from textual.widgets import TextArea

from ferrum_mac.tui.attachments import PASTE_LINES, Attachment, complete_path, pasted, unix_newlines
from ferrum_mac.tui.messages import AttachmentsChanged, PromptSubmitted

NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 10; }
    """

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.attachments: list[Attachment] = []
        self.pastes = 0  # pasted attachments so far, for their names

    def attach(self, attachment: Attachment) -> None:
        self.attachments.append(attachment)
        self.post_message(AttachmentsChanged(list(self.attachments)))

    def take_attachments(self) -> list[Attachment]:
        """The attachments, now sent: the prompt has none left."""
        taken, self.attachments = self.attachments, []
        self.post_message(AttachmentsChanged([]))
        return taken

    async def _on_paste(self, event: events.Paste) -> None:
        # A short paste goes on to TextArea's own handler (Textual calls each class's in turn);
        # prevent_default keeps a long one out of the text.
        if unix_newlines(event.text).count("\n") + 1 > PASTE_LINES:
            event.stop()
            event.prevent_default()
            self.pastes += 1
            self.attach(pasted(event.text, self.pastes))

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text or self.attachments:
                self.post_message(PromptSubmitted(text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "tab" and self.at_word() is not None:
            event.stop()
            event.prevent_default()
            self.complete_at_word()
            return
        if event.key == "backspace" and not self.text and self.attachments:
            event.stop()
            event.prevent_default()
            self.attachments.pop()
            self.post_message(AttachmentsChanged(list(self.attachments)))
            return
        await super()._on_key(event)

    def at_word(self) -> str | None:
        """The `@path` being typed at the cursor (without its `@`), if any."""
        row, column = self.cursor_location
        before = self.document.get_line(row)[:column]
        word = before.rsplit(None, 1)[-1] if before.strip() and not before[-1].isspace() else ""
        return word[1:] if word.startswith("@") else None

    def complete_at_word(self) -> None:
        partial = self.at_word() or ""
        completed, matches = complete_path(partial, Path.cwd())
        if completed != partial:
            self.insert(completed[len(partial) :])
        elif len(matches) > 1:
            self.notify("  ".join(matches), title="Files", timeout=4)
