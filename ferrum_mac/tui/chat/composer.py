"""The message being written on the chat screen: sent from the prompt, its attachments counted, an earlier one edited."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual.widgets import Label

from ferrum_mac.errors import FerrumError
from ferrum_mac.tui.attachments import at_paths, message_text, read_attachment, split_message
from ferrum_mac.tui.token_count import count_tokens
from ferrum_mac.tui.widgets.attachment_chips import AttachmentChips, chip_text
from ferrum_mac.tui.widgets.prompt_input import PromptInput

if TYPE_CHECKING:
    from ferrum_mac.tui.screens.chat_screen import ChatScreen


class Composer:
    """The prompt's side: what is sent, what it carries, and which earlier message it replaces."""

    def __init__(self, screen: ChatScreen):
        self.screen = screen
        self.editing_id: int | None = None  # the user message being edited, if any
        self.pending_tokens = 0  # what the prompt's attachments will add to the context

    async def submit(self, typed: str) -> None:
        """Send what was typed with the prompt's attachments and the files its @paths name."""
        screen = self.screen
        if screen.busy:
            screen.notify("Still answering; Esc stops the answer.", severity="warning")
            return
        if screen.app.engine is None:
            screen.notify("The model is still loading.", severity="warning")
            return
        prompt = screen.query_one(PromptInput)
        try:
            attached = [read_attachment(path, Path.cwd()) for path in at_paths(typed, Path.cwd())]
        except FerrumError as e:
            screen.notify(str(e), severity="error", timeout=10)
            return
        attachments = prompt.attachments + attached
        text = message_text(typed, attachments)
        if not self.fits(text):
            return
        if self.editing_id is not None:
            await screen.conversations.branch_before(self.editing_id)
        prompt.clear()
        prompt.take_attachments()
        await screen.answers.send(text, attachments=[a.described() for a in attachments])

    def fits(self, text: str) -> bool:
        """Whether the message alone fits the context; if not, say so (nothing is sent)."""
        tokens, capacity = count_tokens(self.screen.app.engine, text), self.screen.figures.capacity()
        if capacity and tokens >= capacity:
            self.screen.notify(
                f"This message is {tokens} tokens and the context holds {capacity}: attach less.",
                severity="error",
                timeout=10,
            )
            return False
        return True

    # -- attachments --------------------------------------------------------------------------

    def ask_attachment(self) -> None:
        from ferrum_mac.tui.screens.text_prompt_screen import PathPromptScreen

        question = "Attach a text file: its path (Tab completes it; or type @path in the prompt)"
        self.screen.app.push_screen(PathPromptScreen(question), self.attach_path)

    def attach_path(self, path: str | None) -> None:
        if not path:
            return
        try:
            attachment = read_attachment(path, Path.cwd())
        except FerrumError as e:
            self.screen.notify(str(e), severity="error", timeout=10)
            return
        prompt = self.screen.query_one(PromptInput)
        prompt.attach(attachment)
        prompt.focus()

    async def show_attachments(self, attachments: list) -> None:
        """Chips above the prompt, each with its cost, and the context meter with what they add."""
        engine = self.screen.app.engine
        costs = [count_tokens(engine, a.block()) for a in attachments]
        chips = [chip_text(a.name, a.lines, cost) for a, cost in zip(attachments, costs)]
        await self.screen.query_one(AttachmentChips).show(chips)
        self.pending_tokens = sum(costs)
        self.screen.figures.show_pending()

    # -- editing an earlier message -----------------------------------------------------------

    def edit(self, message_id: int, text: str) -> None:
        """Put user message `message_id` back in the prompt: sent, it goes beside the original."""
        if self.screen.refuse_while_busy():
            return
        self.editing_id = message_id
        prompt = self.screen.query_one(PromptInput)
        typed, attachments = split_message(text)
        prompt.text = typed
        prompt.take_attachments()
        for attachment in attachments:
            prompt.attach(attachment)
        prompt.focus()
        hint = self.screen.query_one("#editing", Label)
        hint.update("Editing an earlier message: Enter resends it as a new branch (← → switch), Esc cancels")
        hint.display = True

    def cancel_edit(self) -> None:
        """Esc while editing: the prompt is emptied and nothing is replaced."""
        if self.editing_id is not None:
            self.end_editing()
            self.screen.query_one(PromptInput).clear()

    def end_editing(self) -> None:
        self.editing_id = None
        self.screen.query_one("#editing").display = False
