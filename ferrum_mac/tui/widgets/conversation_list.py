"""The sidebar: a search box over the conversations, newest first."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Input, Label, ListView

from ferrum_mac.tui.messages import ConversationChosen, SearchChanged
from ferrum_mac.tui.widgets.conversation_item import ConversationItem


class ConversationList(Vertical):
    BINDINGS = [Binding("delete", "screen.delete_chat", "Delete")]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shown: list[tuple[int, str]] = []  # (id, title) of the items in the list

    def compose(self) -> ComposeResult:
        yield Label("Conversations", classes="title")
        yield Input(placeholder="Filter", id="search")
        yield ListView(id="conversations")
        yield Label("^L list  ^N new  F2 rename  Del", classes="hint")

    async def show(self, conversations, selected: int | None) -> None:
        view = self.query_one(ListView)
        shown = [(c.id, c.title) for c in conversations]
        if shown != self.shown:  # rebuilding the list costs a mount per item: only when it changed
            self.shown = shown
            await view.clear()
            await view.extend(ConversationItem(i, title) for i, title in shown)
        ids = [i for i, _ in shown]
        view.index = ids.index(selected) if selected in ids else None

    def highlighted_id(self) -> int | None:
        item = self.query_one(ListView).highlighted_child
        return item.conversation_id if isinstance(item, ConversationItem) else None

    @on(ListView.Selected)
    def _chosen(self, event: ListView.Selected) -> None:
        if isinstance(event.item, ConversationItem):
            self.post_message(ConversationChosen(event.item.conversation_id))

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        self.post_message(SearchChanged(event.value))
