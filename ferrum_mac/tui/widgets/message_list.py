"""The conversation's messages, following the newest text unless the person scrolled up."""

from __future__ import annotations

from textual.containers import VerticalScroll

from ferrum_mac.tui.widgets.message_view import MessageView


class MessageList(VerticalScroll):
    def on_mount(self) -> None:
        self.anchor()  # stays at the bottom as text arrives, until the person scrolls up

    async def show_messages(self, widgets) -> None:
        await self.remove_children()
        await self.mount_all(widgets)
        self.anchor()

    async def add(self, widget) -> None:
        await self.mount(widget)

    def message_views(self) -> list[MessageView]:
        return list(self.query(MessageView))
