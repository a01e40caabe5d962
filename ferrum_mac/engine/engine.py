"""`Engine`: one model with its tokenizer and chat template, and the conversations on it.

Usable from a worker thread: one turn runs at a time per engine (a lock, held from a turn's
first event to its last), and `cancel()` may be called from any thread. Within one thread,
finish or close a turn's stream before starting the next one or closing a conversation.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any, Iterator

from ferrum_mac.engine.conversation import ChatSettings, Conversation
from ferrum_mac.engine.defaults import DEFAULT_MAX_TOKENS
from ferrum_mac.engine.events import Event
from ferrum_mac.engine.sampling import SamplingParams
from ferrum_mac.engine.speculation.step_times import StepTimes
from ferrum_mac.engine.structured import Constraints, ResponseFormat
from ferrum_mac.engine.tools import ToolRequest
from ferrum_mac.engine.turn import run_turn
from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import DecoderOnlyLLM
from ferrum_mac.text import ChatTemplate, Tokenizer

PREPARE_TOKENS = 2048  # cache reserved when a conversation opens; it grows past this as needed


class Engine:
    def __init__(
        self,
        model: DecoderOnlyLLM,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        *,
        name: str = "",
        path: Path | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        device: str = "",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.name = name
        self.path = path
        self.device = device  # where the model runs, for people ("mlx · cpu"); "" when unknown
        self.default_sampling = sampling or SamplingParams()
        # an answer's limit unless the user sets one (None: the end of the context)
        self.default_max_tokens = min(max_tokens, model.kv_capacity()) if max_tokens else None
        self.eos_ids = frozenset(tokenizer.eos_ids) | frozenset(model.config.eos_token_ids)
        self.step_times = StepTimes()  # the model's decode and verify steps, as answers take them
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None
        self._ids = itertools.count(1)
        self._open: dict[str, Conversation] = {}
        # structured output: the grammar vocabulary is built on the first constrained answer
        self.constraints = Constraints(tokenizer, model.config.vocab_size, self.eos_ids)

    @classmethod
    def open(
        cls,
        name: str | Path | None = None,
        *,
        backend: str = "auto",
        device: str | None = None,
        dtype: str | None = None,
        pull: bool = True,
        template: str | None = None,
        kv_capacity: int | None = None,
    ) -> "Engine":
        """`ferrum_mac.compose.open_engine`: the model called `name` (default: $FERRUM_MODEL,
        else the bundled smollm2:135m) as an engine. Kept here for `Engine.open()` in scripts;
        the composition root is imported only when called, so the engine depends on no backend."""
        from ferrum_mac.compose import open_engine

        return open_engine(
            name, backend=backend, device=device, dtype=dtype, pull=pull, template=template, kv_capacity=kv_capacity
        )

    # -- conversations ------------------------------------------------------------------

    def settings(self, **changes) -> ChatSettings:
        """Chat settings with this model's sampling defaults and answer limit, changed as given
        (`max_tokens=None` is an unset option here: the default limit stays)."""
        if changes.get("max_tokens") is None:
            changes.pop("max_tokens", None)
        return ChatSettings(sampling=self.default_sampling, max_tokens=self.default_max_tokens).replace(**changes)

    def conversation(self, settings: ChatSettings | None = None, *, prepare: bool = True, **changes) -> Conversation:
        """A new conversation (its cache allocated and the kernels warmed up when `prepare`)."""
        settings = (settings or self.settings()).replace(**changes)
        conv = Conversation(self, f"conversation-{next(self._ids)}", settings)
        if prepare:
            with self._lock:
                self.model.prepare(conv.cache_id, min(PREPARE_TOKENS, self.model.kv_capacity()))
        self._open[conv.cache_id] = conv
        return conv

    def close_conversation(self, conv: Conversation) -> None:
        """Free the conversation's cache. Idempotent."""
        with self._lock:
            self.model.release(conv.cache_id)
            conv.ledger = []
            conv.closed = True
            self._open.pop(conv.cache_id, None)

    def close(self) -> None:
        for conv in list(self._open.values()):
            conv.close()

    # -- turns ----------------------------------------------------------------------------

    def send(
        self,
        conv: Conversation,
        text: str | None,
        cancel: threading.Event | None = None,
        response_format: ResponseFormat | None = None,
        tools: ToolRequest | None = None,
    ) -> Iterator[Event]:
        """Add the user message `text` to `conv` and stream the answer: TextDelta,
        ReasoningDelta and Notice events, then one Done. Setting `cancel` (or `Engine.cancel()`)
        ends the answer after the current token; the answer so far is kept. `response_format`
        (this answer only; None: the conversation's setting) constrains the answer to JSON.
        `tools`: what the model may call (a `ToolCallRequested` event before Done lists its calls);
        `text` None: answer after the tool results that end the conversation."""
        if conv.closed:
            raise FerrumError(f"conversation {conv.cache_id} is closed; open a new one")
        cancel = cancel or threading.Event()
        with self._lock:
            self._cancel = cancel
            try:
                yield from run_turn(self, conv, text, cancel, response_format, tools)
            finally:
                self._cancel = None

    def cancel(self) -> None:
        """End the answer being generated (from any thread)."""
        if self._cancel is not None:
            self._cancel.set()

    def kv_capacity(self) -> int:
        """The most tokens one conversation's context holds (prompt and answer)."""
        return self.model.kv_capacity()

    def render(
        self, settings: ChatSettings, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[str, list[int]]:
        """The prompt text for `messages` under `settings` (system prompt, thinking) and its ids;
        `tools`: OpenAI tool objects the template describes to the model."""
        system = [{"role": "system", "content": settings.system}] if settings.system is not None else []
        thinking: dict[str, Any] = {} if settings.think is None else {"enable_thinking": settings.think}
        text = self.template.render(system + messages, add_generation_prompt=True, tools=tools, **thinking)
        return text, self.tokenizer.encode(text, add_special_tokens=False)
