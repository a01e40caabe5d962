"""Engine conversations kept resident (their KV cache alive) for the most recently used chats.

Switching back to a resident chat reuses its cache, so only the new message is prefilled; a
chat that was released finds its history in the model's prefix cache while memory keeps it
there (else it prefills it once). Past `max_resident` conversations or `token_budget` tokens
of cache in all, the least recently used is released.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum_mac.engine import ChatEngine

MAX_RESIDENT = 3
TOKEN_BUDGET = 16_384


class ResidentConversations:
    def __init__(self, engine: ChatEngine, max_resident: int = MAX_RESIDENT, token_budget: int = TOKEN_BUDGET):
        self.engine = engine
        self.max_resident = max_resident
        self.token_budget = token_budget
        self._conversations: OrderedDict[int, object] = OrderedDict()

    def get(self, key: int, settings):
        """The engine conversation for chat `key` with `settings`, opened if not resident."""
        conv = self._conversations.pop(key, None)
        if conv is None:
            conv = self.engine.conversation(settings, prepare=False)
        conv.settings = settings
        self._conversations[key] = conv
        self._evict(keep=key)
        return conv

    def is_resident(self, key: int) -> bool:
        return key in self._conversations

    def release(self, key: int) -> None:
        conv = self._conversations.pop(key, None)
        if conv is not None:
            conv.close()

    def release_all(self) -> None:
        for key in list(self._conversations):
            self.release(key)

    def _evict(self, keep: int) -> None:
        while len(self._conversations) > 1 and (
            len(self._conversations) > self.max_resident or self._tokens() > self.token_budget
        ):
            oldest = next(k for k in self._conversations if k != keep)
            self.release(oldest)

    def _tokens(self) -> int:
        return sum(len(conv.ledger) for conv in self._conversations.values())
