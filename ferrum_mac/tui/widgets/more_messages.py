"""A line standing for messages not mounted yet: "▲ 960 earlier messages" at the top of a long
conversation (or "▼ later" below a search hit). Scrolling to it, walking past it with the arrows,
or a click mounts the next window of them. (It takes no focus: focusing it would scroll the list,
which loads a window by itself.)"""

from __future__ import annotations

from textual.widgets import Static


class MoreMessages(Static):
    DEFAULT_CSS = """
    MoreMessages { color: $text-muted; text-align: center; width: 100%; padding: 0 1; margin: 1 0 0 0; }
    MoreMessages:hover { background: $boost; color: $text; }
    """

    def __init__(self, count: int, earlier: bool):
        self.earlier = earlier
        arrow, which, how = ("▲", "earlier", "scroll up") if earlier else ("▼", "later", "↓")
        super().__init__(f"{arrow} {count} {which} message{'s' if count != 1 else ''} ({how} or click)")

    async def on_click(self) -> None:
        await self.parent.load_more(self.earlier)
