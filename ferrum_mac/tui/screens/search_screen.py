"""Full-text search over every conversation: type, move with the arrows, Enter opens the
conversation at that message, Esc closes."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from ferrum_mac.store.history import MATCH_END, MATCH_START, SearchHit

ROLE_NAMES = {"user": "You", "assistant": "Assistant"}


def hit_text(hit: SearchHit) -> Text:
    """Two lines: the conversation's title and who spoke; the matching words in their context."""
    text = Text()
    text.append(hit.title, style="bold")
    text.append(f"  · {ROLE_NAMES.get(hit.role, hit.role)}\n", style="dim")
    text.append_text(marked(" ".join(hit.snippet.split())))
    return text


def marked(snippet: str) -> Text:
    """A snippet with its matched words (between MATCH_START and MATCH_END) highlighted."""
    text = Text()
    for i, part in enumerate(snippet.replace(MATCH_END, MATCH_START).split(MATCH_START)):
        text.append(part, style="bold reverse" if i % 2 else "")
    return text


class SearchScreen(ModalScreen[SearchHit | None]):
    CSS_PATH = "search_screen.tcss"
    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, history, text: str = ""):
        super().__init__()
        self.history = history
        self.text = text
        self.hits: list[SearchHit] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Search every conversation (Enter opens, Esc closes)")
            yield Input(self.text, placeholder="words to find", id="query")
            yield OptionList(id="results")
            yield Label("", id="count")

    def on_mount(self) -> None:
        self.show_hits(self.text)

    @on(Input.Changed, "#query")
    def _changed(self, event: Input.Changed) -> None:
        self.show_hits(event.value)

    def show_hits(self, text: str) -> None:
        self.hits = self.history.search(text)
        results = self.query_one(OptionList)
        results.clear_options()
        results.add_options(Option(hit_text(hit)) for hit in self.hits)
        if self.hits:
            results.highlighted = 0
        found = f"{len(self.hits)} found" if text.strip() else ""
        self.query_one("#count", Label).update(found if self.hits or not text.strip() else "nothing found")

    @on(Input.Submitted, "#query")
    def _open_highlighted(self) -> None:
        index = self.query_one(OptionList).highlighted
        if index is not None and index < len(self.hits):
            self.dismiss(self.hits[index])

    @on(OptionList.OptionSelected)
    def _open(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.hits[event.option_index])

    def on_key(self, event) -> None:
        """Up and Down move through the results while the typing stays in the box."""
        if event.key in ("up", "down") and self.hits:
            event.stop()
            results = self.query_one(OptionList)
            results.action_cursor_down() if event.key == "down" else results.action_cursor_up()
