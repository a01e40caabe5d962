"""Markdown whose code blocks carry a copy action."""

from __future__ import annotations

from textual.widgets import Markdown

from ferrum_mac.tui.widgets.code_fence import CodeFence


class ChatMarkdown(Markdown):
    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}
    DEFAULT_CSS = """
    ChatMarkdown { margin: 0; padding: 0; background: transparent; }
    ChatMarkdown > MarkdownParagraph:last-child { margin-bottom: 0; }
    """
