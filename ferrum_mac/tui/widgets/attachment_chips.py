"""Attachments as one-line chips: "📎 notes.txt · 42 lines" (above the prompt, or under a sent message)."""

from __future__ import annotations

from textual.containers import HorizontalGroup
from textual.widgets import Label


def chip_text(name: str, lines: int, tokens: int | None = None) -> str:
    cost = f" · {tokens} tok" if tokens is not None else ""
    return f"📎 {name} · {lines} line{'s' if lines != 1 else ''}{cost}"


class AttachmentChips(HorizontalGroup):
    DEFAULT_CSS = """
    AttachmentChips { height: auto; padding: 0 1; }
    AttachmentChips > Label { background: $boost; color: $text; padding: 0 1; margin: 0 1 0 0; }
    """

    async def show(self, chips: list[str]) -> None:
        await self.remove_children()
        await self.mount_all(Label(chip, markup=False, classes="chip") for chip in chips)
        self.display = bool(chips)
