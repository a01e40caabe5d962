"""The settings a chat's turns run with: the dialog that changes them, and the draft model they name."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from ferrum_mac.errors import FerrumError
from ferrum_mac.tui.chat_settings import engine_settings, stored_settings, wanted_draft
from ferrum_mac.tui.messages import DraftFailed

if TYPE_CHECKING:
    from ferrum_mac.tui.screens.chat_screen import ChatScreen

NEW_TITLE = "New chat"


class TurnSettings:
    """The current chat's settings (the app's defaults before its first message) and its draft model."""

    def __init__(self, screen: ChatScreen):
        self.screen = screen

    def for_turn(self):
        """The current chat's engine settings, and the draft model they name that is not loaded
        yet (None: none): the turn speculates with auto until it is."""
        app = self.screen.app
        stored = self.screen.history.conversation(self.screen.current_id).settings
        name = wanted_draft(stored)
        draft = app.drafts.loaded(app.engine, name) if name else None
        return engine_settings(app.engine, stored, draft), (name if name and draft is None else None)

    def open_dialog(self) -> None:
        from ferrum_mac.tui.screens.settings_screen import SettingsScreen

        app, chat_id = self.screen.app, self.screen.current_id
        if chat_id is None:
            title, settings = NEW_TITLE, stored_settings(app.default_settings)
        else:
            chat = self.screen.history.conversation(chat_id)
            title, settings = chat.title, stored_settings(chat.settings)
        engine = app.engine
        find_drafts = partial(app.services.draft_models, engine) if engine is not None else None
        app.push_screen(SettingsScreen(title, settings, find_drafts, defaults_in_force(engine)), self.saved)

    async def saved(self, settings: dict | None) -> None:
        if settings is None:
            return
        if self.screen.current_id is None:
            self.screen.app.default_settings = settings
        else:
            self.screen.history.save_settings(self.screen.current_id, settings)
        self.screen.notify("Settings saved.")
        self.load_draft(settings)

    def load_draft(self, settings: dict) -> None:
        """Load the draft model `settings` name now, off the UI thread, so a bad one is said at once."""
        app = self.screen.app
        name, engine = wanted_draft(settings), app.engine
        if name and engine is not None and app.drafts.loaded(engine, name) is None:
            self.screen.notify(f"Loading the draft model {name}…")
            app.engine_thread.run(app.drafts.load, engine, name, self.screen.current_id, self.screen.post_message)

    def draft_failed(self, event: DraftFailed) -> None:
        """Say why, and fall back to auto where the settings still name that draft."""
        app = self.screen.app
        self.screen.notify(
            f"Draft model {event.name}: {event.error.rstrip('.')}. Speculation is back to auto.",
            severity="error",
            timeout=15,
        )
        word = f"draft:{event.name}"
        if event.chat_id is None:
            if app.default_settings.get("speculate") == word:
                app.default_settings = stored_settings(app.default_settings, speculate=None)
            return
        try:
            stored = self.screen.history.conversation(event.chat_id).settings
        except FerrumError:  # deleted while the draft loaded
            return
        if stored.get("speculate") == word:
            self.screen.history.save_settings(event.chat_id, stored_settings(stored, speculate=None))


def defaults_in_force(engine) -> dict:
    """The model's defaults the settings dialog shows in its empty fields ({} before it loads,
    and for a server, which applies its own: "model default")."""
    if engine is None or getattr(engine, "server_chooses_sampling", False):
        return {}
    settings = engine.settings()
    return {
        "temperature": settings.sampling.temperature,
        "top_p": settings.sampling.top_p,
        "max_tokens": settings.max_tokens,
    }
