"""The engine's surface as its users see it, declared once.

`ChatEngine` is what the chat interfaces (the TUI, the REPL, `ferrum run`) use: a local
`Engine`, a `RemoteEngine` (an OpenAI-compatible server) and the tests' scripted engine all
offer it. `LocalEngine` adds what the server batches on: the model itself, its tokenizer,
chat template and end-of-sequence ids, which only an engine on this machine has.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ferrum_mac.engine.conversation import ChatSettings, Conversation
    from ferrum_mac.engine.events import Event
    from ferrum_mac.engine.sampling import SamplingParams
    from ferrum_mac.engine.structured import Constraints, ResponseFormat
    from ferrum_mac.engine.tools import ToolRequest
    from ferrum_mac.llm import DecoderOnlyLLM
    from ferrum_mac.text import ChatTemplate, Tokenizer


@runtime_checkable
class ChatEngine(Protocol):
    # Read-only properties, so an engine may hold a narrower type (a local engine's path is a Path).
    @property
    def name(self) -> str:
        """The model's name as the user gave it (or as the server lists it)."""
        ...

    @property
    def path(self) -> Path | str | None:
        """Where the model comes from: its folder or file, or the server's URL."""
        ...

    @property
    def default_sampling(self) -> SamplingParams:
        """The model's own sampling defaults, where it has them."""
        ...

    def settings(self, **changes) -> ChatSettings:
        """Chat settings with this engine's defaults, changed as given."""
        ...

    def conversation(self, settings: ChatSettings | None = None, *, prepare: bool = True, **changes) -> Conversation:
        """A new conversation on this engine."""
        ...

    def close_conversation(self, conv: Conversation) -> None:
        """Free what the conversation holds (its KV cache). Idempotent."""
        ...

    def send(
        self,
        conv: Conversation,
        text: str | None,
        cancel: threading.Event | None = None,
        response_format: ResponseFormat | None = None,
        tools: ToolRequest | None = None,
    ) -> Iterator[Event]:
        """Add the user message `text` to `conv` and stream the answer's events, ending with one Done;
        `response_format` holds this answer to JSON (None: the conversation's setting); `tools`:
        what the model may call (its calls come as a `ToolCallRequested`); `text` None: the
        answer to the tool results the conversation ends with."""
        ...

    def cancel(self) -> None:
        """End the answer being generated after its current token (from any thread)."""
        ...

    def kv_capacity(self) -> int | None:
        """The most tokens one conversation holds; None where a server does not say."""
        ...

    def close(self) -> None:
        """Close every conversation and whatever connection the engine holds."""
        ...


@runtime_checkable
class LocalEngine(ChatEngine, Protocol):
    @property
    def model(self) -> DecoderOnlyLLM: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def template(self) -> ChatTemplate: ...

    @property
    def eos_ids(self) -> frozenset[int]:
        """The tokenizer's and the model config's, together."""
        ...

    @property
    def constraints(self) -> Constraints:
        """Structured output on this model: response formats compiled into grammar matchers."""
        ...
