"""A conversation: its messages, its settings, and the ledger of token ids in its KV cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Mapping

from ferrum_mac.engine.sampling import SamplingParams
from ferrum_mac.engine.speculation import Speculate
from ferrum_mac.engine.structured import ResponseFormat
from ferrum_mac.engine.tools import ToolRequest
from ferrum_mac.errors import FerrumError

if TYPE_CHECKING:
    import threading

    from ferrum_mac.engine.surface import ChatEngine
    from ferrum_mac.engine.events import Event
    from ferrum_mac.engine.tools import Tools

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
    speculate: Speculate = field(default_factory=Speculate)  # guess tokens, verify them in one forward

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

    def send(
        self,
        text: str,
        cancel: "threading.Event | None" = None,
        response_format=None,
        *,
        tools: "Tools | None" = None,
        tool_choice: str | Mapping = "auto",
        parallel_tool_calls: bool = True,
    ) -> Iterator["Event"]:
        """Add a user message and stream the answer (see `Engine.send`). `response_format`:
        this answer only, "json", a JSON schema (a dict) or a `ResponseFormat`; None: the
        settings' `response_format`. `tools`: a `Toolbox`, `Tool`s or OpenAI tool objects the
        model may call (`tool_choice` as OpenAI's: "auto", "required", "none" or a function's
        name); its calls come as a `ToolCallRequested` event and are kept in the answer's
        message as `tool_calls`, never as markup in its text."""
        return self._answer(text, cancel, response_format, tools, tool_choice, parallel_tool_calls)

    def add_tool_results(self, results: Mapping[str, str]) -> None:
        """The results of the last answer's calls (call id -> what the tool answered, as text), as
        `tool` messages the model reads at `continue_answer`. An id that names no call of that
        answer is a `FerrumError`, and then nothing is added."""
        called = [c["id"] for c in self._last_calls()]
        unknown = sorted(set(results) - set(called))
        if unknown:
            raise FerrumError(
                f"no call of the last answer has the id {unknown[0]!r}; its calls are {', '.join(called) or 'none'}"
            )
        for call_id in called:
            if call_id in results:
                self.messages.append({"role": "tool", "tool_call_id": call_id, "content": str(results[call_id])})

    def continue_answer(
        self,
        cancel: "threading.Event | None" = None,
        response_format=None,
        *,
        tools: "Tools | None" = None,
        tool_choice: str | Mapping = "auto",
        parallel_tool_calls: bool = True,
    ) -> Iterator["Event"]:
        """The model's next answer after the tool results (`add_tool_results`), with no new user
        message; the same arguments as `send`. Pass the tools again if it may call more."""
        if not self.messages or self.messages[-1].get("role") != "tool":
            raise FerrumError("nothing to continue: add the tool results (add_tool_results) first")
        return self._answer(None, cancel, response_format, tools, tool_choice, parallel_tool_calls)

    def _answer(self, text, cancel, response_format, tools, tool_choice, parallel) -> Iterator["Event"]:
        changes: dict = {}
        if response_format is not None:
            changes["response_format"] = ResponseFormat.parse(response_format)
        if tools is not None:
            request = ToolRequest.of(tools, tool_choice, parallel)
            if request is not None:
                changes["tools"] = request
        return self.engine.send(self, text, cancel, **changes)

    def _last_calls(self) -> list[dict]:
        """The calls of the last assistant message (after it only tool results)."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return list(message.get("tool_calls") or ())
            if message.get("role") != "tool":
                break
        return []

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
