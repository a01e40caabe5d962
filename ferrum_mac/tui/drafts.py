"""The draft model speculation guesses with, loaded on the engine thread beside the chat's model.

One at a time: a draft is a second model in memory. It belongs to the engine it was checked
against (the same vocabulary), so after a model switch it is loaded and checked again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferrum_mac.tui.messages import DraftFailed, DraftOpened

if TYPE_CHECKING:
    from ferrum_mac.engine import ChatEngine, Conversation
    from ferrum_mac.engine.speculation import Speculate


class DraftModels:
    def __init__(self, services):
        self.services = services
        self._loaded: tuple[ChatEngine, Speculate] | None = None  # one attribute: read from the UI thread

    def loaded(self, engine: ChatEngine, name: str) -> Speculate | None:
        """The draft `name` when it is loaded for `engine`, else None."""
        loaded = self._loaded
        if loaded is not None and loaded[0] is engine and loaded[1].draft_name == name:
            return loaded[1]
        return None

    def load(self, engine: ChatEngine, name: str, chat_id: int | None, post) -> Speculate | None:
        """On the engine thread: the draft `name` for `engine`, loaded unless it is already;
        posts DraftOpened, or DraftFailed and returns None (the app keeps running)."""
        draft = self.loaded(engine, name)
        if draft is not None:
            return draft
        self.forget()  # before loading the next: two drafts need not fit in memory at once
        try:
            draft = self.services.open_draft(engine, name)
        except Exception as e:  # a missing, broken or mismatched model: said in the app
            post(DraftFailed(name, chat_id, str(e).splitlines()[0] if str(e) else type(e).__name__))
            return None
        self._loaded = (engine, draft)
        post(DraftOpened(name))
        return draft

    def load_into(self, conv: Conversation, name: str, chat_id: int | None, post) -> None:
        """On the engine thread, before the turn: `conv` speculates with the draft `name`."""
        draft = self.load(conv.engine, name, chat_id, post)
        if draft is not None:
            conv.settings = conv.settings.replace(speculate=draft)

    def forget(self) -> None:
        self._loaded = None
