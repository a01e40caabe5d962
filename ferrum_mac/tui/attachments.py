"""Text attached to a message: a file (`@path` in the prompt, or Ctrl+O) or a large paste.

An attachment is sent as part of the message, after what was typed, each in a block that names
it, so the model sees where it starts and ends; the history keeps the whole text (search finds
it) and the message's stats list the attachments, so the view shows them as chips again.
Binary files, folders and files past MAX_BYTES are refused with a one-line reason.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ferrum_mac.errors import FerrumError

MAX_BYTES = 256 * 1024  # more than a small model's whole context; a larger file is a mistake
PASTE_LINES = 20  # a paste longer than this becomes a chip instead of filling the prompt
SNIFF_BYTES = 8192  # a NUL byte in the first this many says binary
AT_PATH = re.compile(r"(?:^|(?<=\s))@(\S+)")  # `@path` at the start of a word (not in user@host)
COMPLETIONS_SHOWN = 8
BLOCK = re.compile(r'<attachment name="(?P<name>[^"\n]*)">\n(?P<text>.*?)\n</attachment>(?:\n\n|$)', re.S)


@dataclass(frozen=True)
class Attachment:
    name: str
    text: str

    @property
    def lines(self) -> int:
        return self.text.count("\n") + (not self.text.endswith("\n"))

    def block(self) -> str:
        name = self.name.replace('"', "'").replace("\n", " ")
        return f'<attachment name="{name}">\n{self.text.rstrip()}\n</attachment>'

    def described(self) -> dict:
        return {"name": self.name, "lines": self.lines}


def read_attachment(path: str, folder: Path) -> Attachment:
    """The text file at `path` (relative to `folder`, `~` expanded), or a FerrumError saying why not."""
    file = (folder / Path(path).expanduser()).resolve()
    if not file.exists():
        raise FerrumError(f"cannot attach {path}: no such file")
    if not file.is_file():
        raise FerrumError(f"cannot attach {path}: not a file")
    size = file.stat().st_size
    if size > MAX_BYTES:
        raise FerrumError(f"cannot attach {path}: {size // 1024} KiB, more than the {MAX_BYTES // 1024} KiB allowed")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise FerrumError(f"cannot attach {path}: {e.strerror or e}") from None
    if b"\0" in data[:SNIFF_BYTES]:
        raise FerrumError(f"cannot attach {path}: a binary file, not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FerrumError(f"cannot attach {path}: not UTF-8 text") from None
    return Attachment(file.name, text)


def pasted(text: str, number: int) -> Attachment:
    return Attachment(f"pasted text {number}", unix_newlines(text))


def unix_newlines(text: str) -> str:
    """`text` with CR LF and lone CR line ends as LF: tmux and some terminals paste lines ended by CR."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def at_paths(text: str, folder: Path) -> list[str]:
    """The `@path` words of `text` that name an existing file (other @words are left as text)."""
    return [p for p in AT_PATH.findall(text) if (folder / Path(p).expanduser()).is_file()]


def message_text(typed: str, attachments: list[Attachment]) -> str:
    """What is sent and kept: the typed text, then each attachment's block."""
    return "\n\n".join([*([typed] if typed else []), *(a.block() for a in attachments)])


def split_message(content: str) -> tuple[str, list[Attachment]]:
    """A sent message's typed text and its attachments, as `message_text` joined them."""
    blocks = list(BLOCK.finditer(content))
    if not blocks:
        return content, []
    typed = content[: blocks[0].start()].removesuffix("\n\n")
    return typed, [Attachment(m["name"], m["text"]) for m in blocks]


def complete_path(partial: str, folder: Path) -> tuple[str, list[str]]:
    """`partial` completed as far as the entries under `folder` agree (a folder gets its "/"),
    and the entries that matched (at most COMPLETIONS_SHOWN)."""
    head, _, stem = partial.rpartition("/")
    parent = folder / Path(head or "/").expanduser() if "/" in partial else folder
    try:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(parent) if e.name.startswith(stem))
    except OSError:
        return partial, []
    names = [n for n in names if not n.startswith(".") or stem.startswith(".")]
    if not names:
        return partial, []
    common = os.path.commonprefix(names)
    return (f"{head}/" if "/" in partial else "") + common, names[:COMPLETIONS_SHOWN]
