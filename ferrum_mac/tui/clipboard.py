"""Copy text to the clipboard from any terminal, and say where it went.

The terminal's clipboard escape (OSC 52) is always sent: it reaches the clipboard of the machine
the person sits at, over SSH too, where the terminal allows it. Not every terminal does (macOS's
Terminal, tmux without set-clipboard), so the system's own clipboard command is used as well
where there is one; with none, the text is also written to a file whose path the notice shows.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# the first of these found on PATH receives the text on stdin
CLIPBOARD_COMMANDS = (
    ("pbcopy",),
    ("wl-copy",),
    ("xclip", "-selection", "clipboard"),
    ("xsel", "--clipboard", "--input"),
)
COMMAND_TIMEOUT_S = 2.0
FALLBACK_FILE = "clipboard.txt"


def system_copy(text: str) -> str | None:
    """Hand `text` to the system's clipboard command; its name, or None where none worked."""
    for command in CLIPBOARD_COMMANDS:
        program = shutil.which(command[0])
        if program is None:
            continue
        try:
            done = subprocess.run(
                [program, *command[1:]], input=text.encode(), capture_output=True, timeout=COMMAND_TIMEOUT_S
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return command[0]
    return None


def copy_text(app, text: str, what: str, folder: Path) -> str:
    """Copy `text` (OSC 52, plus the system clipboard or a file in `folder`); the notice to show."""
    app.copy_to_clipboard(text)
    if system_copy(text) is not None:
        return f"Copied the {what}."
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FALLBACK_FILE
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        return f"Copied the {what} through the terminal (OSC 52); no clipboard command here and {folder}: {e.strerror or e}"
    return (
        f"Copied the {what} through the terminal (OSC 52). If it does not paste, your terminal blocks that: "
        f"the text is also in {path.resolve()}"
    )
