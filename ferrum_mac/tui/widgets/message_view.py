"""One message: who said it, the reasoning (collapsible) and the text as Markdown.

An assistant message being answered streams through `MarkdownStream`; `finish` settles it.
Focused (click, Tab, Ctrl+Up, or the arrows from another), `c` copies it, `b` its last code block
and, on a user message, `e` edits and resends it. A
message with siblings (an edit or a regenerated answer beside it) shows "‹ 2/3 ›"; the left and
right arrows move between them.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Static

from ferrum_mac.tui.attachments import split_message
from ferrum_mac.tui.messages import BranchRequested, CopyRequested, EditRequested
from ferrum_mac.tui.widgets.attachment_chips import AttachmentChips, chip_text
from ferrum_mac.tui.widgets.chat_markdown import ChatMarkdown

ROLE_LABELS = {"user": "You", "assistant": "Assistant"}


class MessageView(Vertical, can_focus=True):
    BINDINGS = [
        Binding("c", "copy", "Copy"),
        Binding("e", "edit", "Edit & resend"),
        Binding("b", "copy_code", "Copy code"),
        Binding("up", "step(-1)", "Previous message", show=False),
        Binding("down", "step(1)", "Next message", show=False),
        Binding("left", "branch(-1)", "Previous branch", show=False),
        Binding("right", "branch(1)", "Next branch", show=False),
    ]

    def __init__(
        self,
        role: str,
        content: str = "",
        reasoning: str = "",
        *,
        message_id: int | None = None,
        show_reasoning: bool = False,
        footer: str = "",
        branch: tuple[int, int] = (1, 1),
        attachments: bool = False,
    ):
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.reasoning = reasoning
        self.message_id = message_id
        self.show_reasoning = show_reasoning
        self.footer = footer
        self.branch = branch
        self.attachments = attachments  # the content ends in attachment blocks, shown as chips
        self._stream = None

    def compose(self) -> ComposeResult:
        yield Label(self.role_text(), classes="role")
        if self.reasoning:  # most messages have none: no collapsible to mount for them
            yield self.reasoning_box()
        typed, attached = split_message(self.content) if self.attachments else (self.content, [])
        yield ChatMarkdown(typed)
        if attached:
            with AttachmentChips():
                for a in attached:
                    yield Label(chip_text(a.name, a.lines), markup=False, classes="chip")
        yield Label(self.footer, classes="footer", markup=False)

    def on_mount(self) -> None:
        self.query_one(".footer").display = bool(self.footer)

    def reasoning_box(self) -> Collapsible:
        text = Static(self.reasoning, markup=False, classes="reasoning-text")
        return Collapsible(text, title="Reasoning", collapsed=not self.show_reasoning, classes="reasoning")

    # -- streaming --------------------------------------------------------------------------

    async def append(self, text: str, reasoning: str) -> None:
        if reasoning:
            self.reasoning += reasoning
            boxes = self.query(Collapsible)
            if boxes:
                boxes.first().query_one(".reasoning-text", Static).update(self.reasoning)
            else:
                await self.mount(self.reasoning_box(), after=self.query_one(".role"))
        if text:
            self.content += text
            if self._stream is None:
                self._stream = ChatMarkdown.get_stream(self.query_one(ChatMarkdown))
            await self._stream.write(text)

    async def finish(self, content: str, reasoning: str, footer: str, message_id: int | None) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.message_id = message_id
        if content != self.content:
            self.content = content
            await self.query_one(ChatMarkdown).update(content)
        if reasoning != self.reasoning:
            await self.append("", reasoning[len(self.reasoning) :] if reasoning.startswith(self.reasoning) else "")
        self.set_footer(footer)

    def set_footer(self, footer: str) -> None:
        self.footer = footer
        label = self.query_one(".footer", Label)
        label.update(footer)
        label.display = bool(footer)

    def role_text(self) -> Text:
        """Who spoke, and where siblings exist, which of them this is: "You  ‹ 2/3 ›"."""
        text = Text(ROLE_LABELS.get(self.role, self.role))
        place, count = self.branch
        if count > 1:
            text.append(f"  ‹ {place}/{count} ›", style="not bold")
        return text

    def set_branch(self, branch: tuple[int, int]) -> None:
        self.branch = branch
        self.query_one(".role", Label).update(self.role_text())

    def set_reasoning_shown(self, shown: bool) -> None:
        self.show_reasoning = shown
        for box in self.query(Collapsible):
            box.collapsed = not shown

    # -- actions ------------------------------------------------------------------------------

    def action_copy(self) -> None:
        self.post_message(CopyRequested(self.content, "message"))

    def action_copy_code(self) -> None:
        """The last code block of the message (the one an answer usually ends with)."""
        fences = list(self.query("CodeFence"))
        if fences:
            self.post_message(CopyRequested(fences[-1].code, "code block"))
        else:
            self.notify("No code block in this message.", severity="warning")

    async def action_step(self, step: int) -> None:
        await self.screen.focus_next_message(self, step)

    def action_branch(self, step: int) -> None:
        if self.message_id is not None and self.branch[1] > 1:
            self.post_message(BranchRequested(self.message_id, step))

    def action_edit(self) -> None:
        if self.role == "user" and self.message_id is not None:
            self.post_message(EditRequested(self.message_id, self.content))
