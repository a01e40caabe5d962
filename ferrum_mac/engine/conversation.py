"""A conversation: its messages, its settings, and the ledger of token ids in its KV cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from ferrum_mac.engine.sampling import SamplingParams
from ferrum_mac.engine.structured import ResponseFormat
from ferrum_mac.errors import FerrumError

if TYPE_CHECKING:
    import threading

    from ferrum_mac.engine.surface import ChatEngine
    from ferrum_mac.engine.events import Event

ERROR = "error"  # a turn that does not fit raises ContextLimitError
TRUNCATE_OLDEST = "truncate-oldest"  # a turn that does not fit drops the oldest turns first
CONTEXT_POLICIES = (ERROR, TRUNCATE_OLDEST)


@dataclass
class ChatSettings:
    system: str | None = None  # None: the template's own default (if it has one)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: until the end of the answer or of the context
    think: bool | None = None  # enable_thinking for templates that read it; None: the template's default
    context_policy: str = ERROR
    stop: tuple[str, ...] = ()
    # what every answer must be: None (free text) or `ResponseFormat` (JSON, maybe a schema)
    response_format: ResponseFormat | None = None

    def checked(self) -> "ChatSettings":
        if self.context_policy not in CONTEXT_POLICIES:
            raise FerrumError(
                f"unknown context policy {self.context_policy!r}; choose one of: {', '.join(CONTEXT_POLICIES)}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise FerrumError(f"max_tokens {self.max_tokens} must be at least 1")
        self.sampling.checked()
        return self

    def replace(self, **changes) -> "ChatSettings":
        return dataclasses.replace(self, **changes).checked()


class Conversation:
    """Messages (user and assistant turns; the system prompt lives in `settings`) and `ledger`,
    the token ids the model's cache `cache_id` holds, always equal to what the cache holds.

    Open one with `Engine.conversation()`; `send` a message to get its answer as events.
    """

    def __init__(self, engine: "ChatEngine", cache_id: str, settings: ChatSettings):
        self.engine = engine
        self.cache_id = cache_id
        self.settings = settings.checked()
        self.messages: list[dict] = []
        self.ledger: list[int] = []
        self.closed = False

    def send(self, text: str, cancel: "threading.Event | None" = None, response_format=None) -> Iterator["Event"]:
        """Add a user message and stream the answer (see `Engine.send`). `response_format`:
        this answer only, "json", a JSON schema (a dict) or a `ResponseFormat`; None: the
        settings' `response_format`."""
        if response_format is None:
            return self.engine.send(self, text, cancel)
        return self.engine.send(self, text, cancel, response_format=ResponseFormat.parse(response_format))

    def chat_messages(self) -> list[dict]:
        """What the chat template renders: the system prompt (if any), then the turns."""
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system is not None else []
        return system + self.messages

    def clear(self) -> None:
        """Forget the turns; keep the settings. The cache is trimmed at the next turn, and
        whatever prefix still matches (the system prompt) is reused."""
        self.messages = []

    def close(self) -> None:
        self.engine.close_conversation(self)

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
