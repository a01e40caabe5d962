"""The key bindings, as a modal."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# ferrum-chat

| Key | Does |
|---|---|
| Enter | send the message |
| Shift+Enter, Ctrl+J | new line in the message |
| Ctrl+O | attach a text file (or type `@path`; Tab completes the path) |
| Backspace (empty prompt) | drop the last attachment (a paste of 20+ lines becomes one) |
| Esc | stop the answer (the partial answer is kept) |
| Ctrl+R | regenerate the last answer (the old one stays, as a branch) |
| Ctrl+T | show or hide the reasoning |
| Ctrl+N | new conversation |
| Ctrl+F | search every conversation's messages (Enter opens one there) |
| F2 | rename the conversation |
| Delete (in the sidebar) | delete the conversation |
| F3 | export the conversation to Markdown (into Documents/ferrum-chat) |
| F4 | choose or pull a model |
| Ctrl+S | this conversation's settings |
| Ctrl+L | the conversation list (↑ ↓, Enter opens); Ctrl+L again: back to the prompt |
| Ctrl+↑ | the last message; ↑ ↓ move between messages |
| Tab | move between the sidebar, the messages and the prompt |
| c (on a message) | copy it; b copies its last code block (so does the *copy* label on a block) |
| e (on your message) | edit it and resend from there (the old path stays, as a branch) |
| ← → (on a message marked ‹ 2/3 ›) | switch between its branches (edits, regenerated answers) |
| Ctrl+P | command palette (themes too) |
| F1 | this help |
| Ctrl+Q | quit |

Conversations are saved as they happen; reopen `ferrum-chat` to find them again.
"""


class HelpScreen(ModalScreen[None]):
    CSS_PATH = "help_screen.tcss"
    BINDINGS = [Binding("escape,q,f1", "dismiss(None)", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
