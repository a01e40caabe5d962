"""A conversation as a Markdown document."""

from __future__ import annotations

import re
from pathlib import Path

ROLE_HEADINGS = {"user": "You", "assistant": "Assistant"}


def conversation_markdown(title: str, messages) -> str:
    parts = [f"# {title}\n"]
    for m in messages:
        if m.role == "notice":
            parts.append(f"> {m.content}\n")
            continue
        parts.append(f"## {ROLE_HEADINGS.get(m.role, m.role)}\n")
        if m.reasoning:
            parts.append("<details><summary>Reasoning</summary>\n\n" + m.reasoning.strip() + "\n\n</details>\n")
        parts.append(m.content.strip() + "\n")
    return "\n".join(parts)


def default_export_dir() -> Path:
    """Where exports go unless the app is told otherwise: a folder of the user's documents, not
    whatever folder the app was started in."""
    from ferrum_mac.settings import export_dir

    return export_dir()


def export_path(folder: Path, title: str) -> Path:
    """A new file in `folder` named after the title (never overwrites)."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:60] or "conversation"
    path = folder / f"{stem}.md"
    n = 2
    while path.exists():
        path = folder / f"{stem}-{n}.md"
        n += 1
    return path
