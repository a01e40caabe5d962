"""One conversation in the sidebar."""

from __future__ import annotations

from textual.widgets import Label, ListItem


class ConversationItem(ListItem):
    def __init__(self, conversation_id: int, title: str):
        super().__init__(Label(title, markup=False))
        self.conversation_id = conversation_id
