"""The status bar's figures on the chat screen: the model, the last answer's speed, context used, memory."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.css.query import NoMatches

from ferrum_mac.tui.messages import AnswerChunk
from ferrum_mac.tui.widgets.status_bar import StatusBar

if TYPE_CHECKING:
    from ferrum_mac.tui.screens.chat_screen import ChatScreen

STATUS_SECONDS = 0.5  # the status bar's figures change at most this often while an answer streams


class StatusFigures:
    """What the status bar shows: the last answer's figures, or the streaming answer's own."""

    def __init__(self, screen: ChatScreen):
        self.screen = screen
        self.shown_at = 0.0  # when the streaming figures were last shown

    def refresh(self) -> None:
        try:
            self._refresh()
        except NoMatches:  # the app is closing, its widgets going; the timer fired late
            pass

    def _refresh(self) -> None:
        status = self.screen.query_one(StatusBar)
        app = self.screen.app
        status.show_model(app.model_name, app.device_text)
        if not self.screen.busy:  # while an answer streams, its own figures are shown (show_streaming)
            stats = self.last_answer_stats()
            status.show_speed(stats.get("decode_tps"))
            status.show_context(stats.get("context_used", 0), self.capacity(), self.screen.composer.pending_tokens)
        status.show_memory(app.memory_text())

    def show_pending(self) -> None:
        """The context meter with what the prompt's attachments will add (kept while an answer streams)."""
        if not self.screen.busy:
            status = self.screen.query_one(StatusBar)
            status.show_context(self.context_used(), self.capacity(), self.screen.composer.pending_tokens)

    def show_streaming(self, event: AnswerChunk, turn_context: int) -> None:
        """The answer's tokens and speed so far, at most every STATUS_SECONDS; `turn_context`: the
        tokens held before the answer."""
        now = time.monotonic()
        if now - self.shown_at >= STATUS_SECONDS:
            self.shown_at = now
            status = self.screen.query_one(StatusBar)
            status.show_streaming(event.pieces, event.pieces_per_second)
            status.show_context(turn_context + event.pieces, self.capacity())

    def capacity(self) -> int:
        engine = self.screen.app.engine
        return (engine.kv_capacity() or 0) if engine is not None else 0  # a remote may not say

    def context_used(self) -> int:
        return self.last_answer_stats().get("context_used", 0)

    def last_answer_stats(self) -> dict:
        chat_id = self.screen.current_id
        if chat_id is None:
            return {}
        answers = [m for m in self.screen.history.messages(chat_id) if m.role == "assistant"]
        return answers[-1].stats if answers else {}
