"""A line in the conversation that is not a message: a dropped-turns notice, an error."""

from __future__ import annotations

from textual.widgets import Static


class NoticeLine(Static):
    DEFAULT_CSS = """
    NoticeLine { color: $warning; padding: 0 2; margin: 0 0 1 0; text-style: italic; }
    NoticeLine.error { color: $error; }
    """

    def __init__(self, text: str, error: bool = False):
        super().__init__(text, markup=False, classes="error" if error else "")
