"""ChatApp: the engine (opened in a worker thread), the history, and the conversations resident on it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from ferrum_mac.tui.drafts import DraftModels
from ferrum_mac.tui.engine_thread import EngineThread
from ferrum_mac.tui.export import default_export_dir
from ferrum_mac.tui.messages import EngineFailed, EngineOpened
from ferrum_mac.tui.resident import ResidentConversations
from ferrum_mac.tui.screens.chat_screen import ChatScreen

if TYPE_CHECKING:
    from ferrum_mac.engine import ChatEngine

MEMORY_REFRESH_SECONDS = 2.0
DEMO_NOTICE_SECONDS = 30


class ChatApp(App):
    TITLE = "ferrum-chat"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]  # Textual's own, shown in the footer

    def __init__(
        self,
        services,
        history,
        model: str | None = None,
        default_settings: dict | None = None,
        export_dir: Path | None = None,
        open_id: int | None = None,
    ):
        """`open_id`: the conversation shown first (default: the latest)."""
        super().__init__()
        self.open_id = open_id
        self.services = services
        self.history = history
        self.model_name = model or services.default_model()
        self.default_settings = default_settings or {}
        self.export_dir = export_dir or default_export_dir()
        self.engine: ChatEngine | None = None
        self.resident: ResidentConversations | None = None
        self.device_text = "loading…"
        self.engine_thread = EngineThread()
        self.drafts = DraftModels(services)  # speculation's draft model, loaded on the engine thread

    def on_mount(self) -> None:
        self.push_screen(ChatScreen())
        self.open_engine(self.model_name)
        self.set_interval(MEMORY_REFRESH_SECONDS, self.refresh_status)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    def refresh_status(self) -> None:
        self.chat.refresh_status()

    def memory_text(self) -> str:
        from ferrum_mac.store.units import human_bytes

        return human_bytes(self.services.memory_bytes())

    # -- the engine -------------------------------------------------------------------------

    def open_engine(self, name: str) -> None:
        self.engine_thread.run(self._open_engine, name)

    def _open_engine(self, name: str) -> None:
        try:
            engine = self.services.open_engine(name)
            device = self.services.backend_and_device()
        except Exception as e:
            self.post_message(EngineFailed(name, str(e).splitlines()[0] if str(e) else type(e).__name__))
            return
        self.post_message(EngineOpened(engine, device, self.services.demo_notice(engine.name or name)))

    def on_engine_opened(self, event: EngineOpened) -> None:
        self.engine = event.engine
        self.resident = ResidentConversations(event.engine)
        self.model_name = event.engine.name or self.model_name
        self.device_text = event.device
        self.refresh_status()
        if event.notice:
            self.notify(event.notice, title="A demo model", timeout=DEMO_NOTICE_SECONDS)

    def on_engine_failed(self, event: EngineFailed) -> None:
        self.device_text = "not loaded"
        self.refresh_status()
        self.notify(f"cannot open {event.name}: {event.error}", severity="error", timeout=15)

    def switch_model(self, name: str) -> None:
        self.close_engine()
        self.model_name = name
        self.device_text = "loading…"
        self.refresh_status()
        self.open_engine(name)

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.cancel()  # a turn still running ends at its next token
            self.engine_thread.run(self.engine.close)
            self.engine_thread.run(self.drafts.forget)
        self.engine = self.resident = None

    def on_unmount(self) -> None:
        self.close_engine()
        self.engine_thread.shutdown()

    # -- the command palette ------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat
        yield SystemCommand("New conversation", "Start a new conversation (Ctrl+N)", chat.action_new_chat)
        yield SystemCommand("Rename conversation", "Give this conversation a title (F2)", chat.action_rename)
        yield SystemCommand("Delete conversation", "Delete this conversation", chat.action_delete_chat)
        yield SystemCommand(
            "Conversation settings", "System prompt, sampling, thinking, speculation (Ctrl+S)", chat.action_settings
        )
        yield SystemCommand("Choose model", "Switch to a local model or pull one (F4)", chat.action_pick_model)
        yield SystemCommand("Export to Markdown", "Write this conversation to a .md file (F3)", chat.action_export)
        yield SystemCommand("Regenerate answer", "Answer the last message again (Ctrl+R)", chat.action_regenerate)
        yield SystemCommand("Stop answer", "Stop generating, keep the partial answer (Esc)", chat.action_stop)
        yield SystemCommand(
            "Toggle reasoning", "Show or hide the reasoning sections (Ctrl+T)", chat.action_toggle_reasoning
        )
        yield SystemCommand("Search", "Search every conversation's messages (Ctrl+F)", chat.action_search)
        yield SystemCommand("Attach a file", "Send a text file with the next message (Ctrl+O)", chat.action_attach)
        yield SystemCommand("Conversation list", "Move to the list of conversations (Ctrl+L)", chat.action_toggle_list)
        yield SystemCommand("Copy last answer", "Copy the last answer to the clipboard", chat.action_copy_last_answer)
        yield SystemCommand("Key bindings", "Show the help screen (F1)", chat.action_help)


def main(
    model: str | None,
    backend: str,
    db: str | None,
    max_tokens: int | None = None,
    remote: str | None = None,
    api_key: str | None = None,
    device: str | None = None,
    open_id: int | None = None,
) -> None:
    from ferrum_mac.store.history import History
    from ferrum_mac.tui.chat_settings import stored_settings
    from ferrum_mac.tui.services import RemoteServices, Services

    services = RemoteServices(remote, api_key) if remote else Services(backend, device)
    history = History.open(db)
    try:
        if open_id is not None:
            history.conversation(open_id)  # a number that is none: one line now, not an empty app
        app = ChatApp(services, history, model, stored_settings(max_tokens=max_tokens), open_id=open_id)
        app.run()
    finally:
        history.close()
    # Everything is saved and closed. Skip the interpreter's teardown: MLX's C++ destructors
    # at exit can abort ("terminate called without an active exception") after the engine
    # ran on a worker thread, turning a clean quit into exit status 134.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(app.return_code or 0)
