"""The conversation's messages, following the newest text unless the person scrolled up.

A long conversation mounts only what fills the first screen (the last messages, or WINDOW from
a search hit on): a message is a Markdown widget, and mounting a thousand of them takes seconds.
The rest stay stored messages behind a `MoreMessages` line, mounted WINDOW at a time when it is
chosen, when the list is scrolled to its top, or when the arrows walk past the first one shown.
"""

from __future__ import annotations

from textual.containers import VerticalScroll

from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.more_messages import MoreMessages

WINDOW = 20
DEFAULT_ROWS = 40  # the screen's height before the list has been laid out
ROWS_AROUND_A_MESSAGE = 3  # who spoke, the margin, the footer


def rows_needed(content: str, width: int) -> int:
    """About how many rows a message takes at `width` columns (never more than it takes)."""
    lines = content.split("\n")
    return ROWS_AROUND_A_MESSAGE + sum(1 + len(line) // max(width, 20) for line in lines)


def first_filling(items: list, rows: int, width: int) -> int:
    """The index from which the last messages fill `rows` rows (at least two of them shown)."""
    filled, first = 0, len(items)
    while first > 0 and (filled < rows or len(items) - first < 2):
        first -= 1
        filled += rows_needed(items[first].content, width)
    return first


class MessageList(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.items: list = []  # the stored messages of the path shown
        self.make = None  # stored message -> its widget
        self.first = self.last = 0  # items[first:last] are mounted
        self.loading = False  # a window is being mounted

    def on_mount(self) -> None:
        self.anchor()  # stays at the bottom as text arrives, until the person scrolls up

    async def show_messages(self, widgets) -> None:
        """Show these widgets only (the welcome line)."""
        self.items, self.first, self.last = [], 0, 0
        await self.remove_children()
        await self.mount_all(widgets)
        self.anchor()

    async def show_stored(self, items: list, make, around: int | None = None) -> None:
        """Show stored messages `items`, made into widgets by `make`: the last WINDOW, or a window
        that starts a little before index `around`."""
        self.items, self.make = items, make
        if around is None:
            rows, width = self.size.height or DEFAULT_ROWS, self.size.width
            self.first, self.last = first_filling(items, rows, width), len(items)
        else:
            self.first = max(0, around - 3)
            self.last = min(len(items), self.first + WINDOW)
        await self.remove_children()
        widgets = [make(m) for m in items[self.first : self.last]]
        if self.first:
            widgets.insert(0, MoreMessages(self.first, earlier=True))
        if self.last < len(items):
            widgets.append(MoreMessages(len(items) - self.last, earlier=False))
        await self.mount_all(widgets)
        if around is None:
            self.anchor()
        else:
            self.release_anchor()

    @property
    def shows_the_end(self) -> bool:
        return self.last >= len(self.items)

    async def load_more(self, earlier: bool) -> None:
        """Mount the next window of earlier (or later) messages, keeping what was shown in place.
        One window at a time: a click on the marker while a scroll to the top loads would mount
        the same messages twice, with a stale marker between them."""
        if self.loading:
            return
        self.loading = True
        try:
            await self._load_more(earlier)
        finally:
            self.loading = False

    async def _load_more(self, earlier: bool) -> None:
        for line in [m for m in self.query(MoreMessages) if m.earlier == earlier]:
            await line.remove()
        if earlier and self.first:
            start = max(0, self.first - WINDOW)
            widgets = [self.make(m) for m in self.items[start : self.first]]
            if start:
                widgets.insert(0, MoreMessages(start, earlier=True))
            anchor_widget = self.children[0] if self.children else None
            await self.mount_all(widgets, before=0)
            self.first = start
            if anchor_widget is not None:
                self.call_after_refresh(self.scroll_to_widget, anchor_widget, animate=False, top=True)
        elif not earlier and not self.shows_the_end:
            end = min(len(self.items), self.last + WINDOW)
            widgets = [self.make(m) for m in self.items[self.last : end]]
            if end < len(self.items):
                widgets.append(MoreMessages(len(self.items) - end, earlier=False))
            await self.mount_all(widgets)
            self.last = end

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        if new <= 0 < old and self.first:
            self.call_later(self.load_if_at_top)

    async def load_if_at_top(self) -> None:
        """Still at the top once the scroll settled (a window loaded meanwhile moves it down)."""
        if self.scroll_y <= 0 and self.first and not self.loading:
            self.release_anchor()  # the person went up: new text must not pull the view down
            await self.load_more(earlier=True)

    async def add(self, widget) -> None:
        await self.mount(widget)

    def message_views(self) -> list[MessageView]:
        return list(self.query(MessageView))
