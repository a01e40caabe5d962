"""The conversations on the chat screen: the one shown, the sidebar's list, search, rename, delete, export.

The history (sqlite) is the record; what is shown is a window of the current conversation's
path, opened at its end or at a message (a search hit, a branch switched to).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from textual.widgets import Static

from ferrum_mac.tui import tool_turn
from ferrum_mac.tui.chat.answers import answer_footer
from ferrum_mac.tui.widgets.conversation_list import ConversationList
from ferrum_mac.tui.widgets.message_list import MessageList
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.notice_line import NoticeLine
from ferrum_mac.tui.widgets.prompt_input import PromptInput

if TYPE_CHECKING:
    from ferrum_mac.tui.screens.chat_screen import ChatScreen

WELCOME = "Ask anything.  Enter sends · Shift+Enter or Ctrl+J for a new line · F1 for help"
NOTICE_ROLES = ("notice", "error")


class Conversations:
    """Which conversation is shown and how: its messages, the list beside them, focus among them."""

    def __init__(self, screen: ChatScreen):
        self.screen = screen
        self.current_id: int | None = None
        self.search_text = ""  # the sidebar's filter
        self.show_reasoning = False

    @property
    def history(self):
        return self.screen.history

    async def open(self, conversation_id: int | None, at_message: int | None = None) -> None:
        """Show conversation `conversation_id` (None: a new chat), at its end or at `at_message`."""
        screen = self.screen
        self.current_id = conversation_id
        screen.composer.end_editing()
        messages = self.history.messages(conversation_id) if conversation_id else []
        shown = screen.query_one(MessageList)
        if messages:
            around = next((i for i, m in enumerate(messages) if m.id == at_message), None)
            await shown.show_stored(messages, self.message_widget, around)
        else:
            await shown.show_messages([Static(WELCOME, id="welcome")])
        await self.refresh_sidebar()
        screen.refresh_status()
        if at_message is not None:
            screen.call_after_refresh(self.focus_message, at_message)

    def create(self, title: str, settings: dict) -> None:
        """Start a conversation in the history and make it the current one (before its first message)."""
        self.current_id = self.history.new_conversation(title, settings).id

    def message_widget(self, m):
        if m.role in tool_turn.TOOL_ROLES:
            return tool_turn.tool_widget(m)
        if m.role in NOTICE_ROLES:
            return NoticeLine(m.content, error=m.role == "error")
        return MessageView(
            m.role,
            m.content,
            m.reasoning,
            message_id=m.id,
            show_reasoning=self.show_reasoning,
            footer=answer_footer(m.stats) if m.role == "assistant" else "",
            branch=m.branch,
            attachments=bool(m.stats.get("attachments")),
        )

    async def refresh_sidebar(self) -> None:
        conversations = self.history.conversations(self.search_text)
        await self.screen.query_one(ConversationList).show(conversations, self.current_id)

    async def filter(self, text: str) -> None:
        self.search_text = text
        await self.refresh_sidebar()

    async def new_chat(self) -> None:
        if self.screen.refuse_while_busy():
            return
        await self.open(None)
        self.screen.query_one(PromptInput).focus()

    async def choose(self, conversation_id: int) -> None:
        if conversation_id != self.current_id and not self.screen.refuse_while_busy():
            await self.open(conversation_id)

    # -- branches -----------------------------------------------------------------------------

    async def branch_before(self, message_id: int) -> None:
        """Show the path up to message `message_id`'s parent: what is sent next goes beside it."""
        [parent] = [m.parent_id for m in self.history.messages(self.current_id) if m.id == message_id]
        self.history.set_leaf(self.current_id, parent)
        self.screen.composer.end_editing()
        await self.open(self.current_id)

    async def switch_branch(self, message_id: int, step: int) -> None:
        if self.screen.refuse_while_busy() or self.current_id is None:
            return
        shown = self.history.switch_branch(self.current_id, message_id, step)
        if shown is not None:  # the next turn sends this path; the prefix cache holds what it shares
            await self.open(self.current_id, at_message=shown)

    def toggle_reasoning(self) -> None:
        self.show_reasoning = not self.show_reasoning
        for view in self.screen.query(MessageView):
            view.set_reasoning_shown(self.show_reasoning)

    # -- search -------------------------------------------------------------------------------

    def search(self) -> None:
        from ferrum_mac.tui.screens.search_screen import SearchScreen

        self.screen.app.push_screen(SearchScreen(self.history), self.search_chosen)

    async def search_chosen(self, hit) -> None:
        if hit is None or self.screen.refuse_while_busy():
            return
        self.history.show_message(hit.conversation_id, hit.message_id)  # it may be on another branch
        await self.open(hit.conversation_id, at_message=hit.message_id)

    # -- focus --------------------------------------------------------------------------------

    def focus_message(self, message_id: int) -> None:
        for view in self.screen.query(MessageView):
            if view.message_id == message_id:
                view.focus()  # focusing scrolls it into view
                return

    def toggle_list(self) -> None:
        """One key to the conversation list, and the same key back to the prompt."""
        conversations = self.screen.query_one("#conversations")
        if conversations.has_focus:
            self.screen.query_one(PromptInput).focus()
        else:
            conversations.focus()

    def focus_last_message(self) -> None:
        views = self.screen.query_one(MessageList).message_views()
        if views:
            views[-1].focus()

    async def focus_next_message(self, view: MessageView, step: int) -> None:
        shown = self.screen.query_one(MessageList)
        views = shown.message_views()
        place = views.index(view) + step
        if not 0 <= place < len(views) and (shown.first if step < 0 else not shown.shows_the_end):
            await shown.load_more(earlier=step < 0)  # the window's edge: mount the next one
            views = shown.message_views()
            place = views.index(view) + step
        if 0 <= place < len(views):
            views[place].focus()
        elif step > 0:
            self.screen.query_one(PromptInput).focus()

    # -- rename, delete, export ---------------------------------------------------------------

    def rename(self) -> None:
        from ferrum_mac.tui.screens.text_prompt_screen import TextPromptScreen

        chat_id = self.current_id
        if chat_id is None:
            return
        title = self.history.conversation(chat_id).title
        self.screen.app.push_screen(TextPromptScreen("Rename the conversation", title), partial(self.renamed, chat_id))

    async def renamed(self, chat_id: int, title: str | None) -> None:
        if title:
            self.history.rename(chat_id, title)
            await self.refresh_sidebar()

    def delete(self) -> None:
        from ferrum_mac.tui.screens.confirm_screen import ConfirmScreen

        chat_id = self.screen.query_one(ConversationList).highlighted_id() or self.current_id
        if chat_id is None or self.screen.refuse_while_busy():
            return
        title = self.history.conversation(chat_id).title
        self.screen.app.push_screen(
            ConfirmScreen(f"Delete “{title}” and its messages?"), partial(self.deleted, chat_id)
        )

    async def deleted(self, chat_id: int, yes: bool | None) -> None:
        if not yes:
            return
        self.screen.app.resident.release(chat_id)
        self.history.delete(chat_id)
        if chat_id == self.current_id:
            remaining = self.history.conversations()
            await self.open(remaining[0].id if remaining else None)
        else:
            await self.refresh_sidebar()

    def export(self) -> None:
        from ferrum_mac.tui.export import conversation_markdown, export_path

        app = self.screen.app
        if self.current_id is None:
            self.screen.notify("Nothing to export yet.")
            return
        chat = self.history.conversation(self.current_id)
        try:
            app.export_dir.mkdir(parents=True, exist_ok=True)
            path = export_path(app.export_dir, chat.title)
            path.write_text(conversation_markdown(chat.title, self.history.messages(self.current_id)), encoding="utf-8")
        except OSError as e:
            self.screen.notify(f"Cannot export to {app.export_dir}: {e.strerror or e}", severity="error", timeout=15)
            return
        self.screen.notify(f"Exported to {path.resolve()}", timeout=15)
