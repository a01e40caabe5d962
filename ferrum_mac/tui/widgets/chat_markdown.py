"""Markdown whose code blocks carry a copy action and whose line breaks stay where the model put them."""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from textual.widgets import Markdown

from ferrum_mac.tui.widgets.code_fence import CodeFence


def keep_line_breaks(state: StateCore) -> None:
    """Every soft line break as a hard one: a model's poem or list of lines is not a paragraph
    to reflow (as chat apps show it, and markdown-it's `breaks` option renders to HTML)."""
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


def chat_parser() -> MarkdownIt:
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("keep_line_breaks", keep_line_breaks)
    return parser


class ChatMarkdown(Markdown):
    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}
    DEFAULT_CSS = """
    ChatMarkdown { margin: 0; padding: 0; background: transparent; }
    ChatMarkdown > MarkdownParagraph:last-child { margin-bottom: 0; }
    """

    def __init__(self, markdown: str | None = None, **kwargs):
        super().__init__(markdown, parser_factory=chat_parser, **kwargs)
