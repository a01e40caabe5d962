"""A scripted engine with the surface the chat UI uses (`ChatEngine`), and services that hand it out.

A reply is a list of steps: ("text", "..."), ("reasoning", "..."), ("notice", "..."),
("hang",) waits for the stop, ("fail", "message") raises, ("end", reason[, stop string]) ends the
answer for that reason. Text streams word by word.
"""

from __future__ import annotations

import itertools
import threading
import time

from ferrum_mac.engine import ChatSettings, Conversation, Done, Notice, ReasoningDelta, SamplingParams, TextDelta
from ferrum_mac.errors import FerrumError
from ferrum_mac.tui.services import ModelEntry, Services

TOKENS_PER_MESSAGE = 10  # the fake ledger: a fixed count per message, so figures are deterministic
HANG_LIMIT_S = 20


class FakeEngine:
    def __init__(self, replies=(), capacity: int = 2048, name: str = "fake-model:1b", delay: float = 0.0):
        self.name = name
        self.path = None  # no model file behind it
        self.capacity = capacity
        self.delay = delay  # seconds per streamed piece
        self.default_sampling = SamplingParams(temperature=0.0)
        self.replies = list(replies)
        self.turns: list[dict] = []  # what each turn saw: messages before it, text, settings
        self.opened = 0
        self.closed_ids: list[str] = []
        self.hanging = threading.Event()
        self._cancel: threading.Event | None = None
        self._ids = itertools.count(1)

    def settings(self, **changes) -> ChatSettings:
        return ChatSettings(sampling=self.default_sampling).replace(**changes)

    def conversation(self, settings: ChatSettings | None = None, *, prepare: bool = True, **changes) -> Conversation:
        self.opened += 1
        return Conversation(self, f"fake-{next(self._ids)}", (settings or self.settings()).replace(**changes))

    def close_conversation(self, conv: Conversation) -> None:
        conv.ledger = []
        conv.closed = True
        self.closed_ids.append(conv.cache_id)

    def kv_capacity(self) -> int:
        return self.capacity

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def close(self) -> None:
        pass

    def send(
        self, conv: Conversation, text: str, cancel: threading.Event | None = None, response_format=None, tools=None
    ):  # `tools`: a script has no use for them (test_tool_blocks' engine calls them)
        cancel = cancel or threading.Event()
        self._cancel = cancel
        self.turns.append(
            {"history": list(conv.messages), "text": text, "settings": conv.settings, "cached": len(conv.ledger)}
        )
        reply = self.replies.pop(0) if self.replies else [("text", f"You said: {text}")]
        conv.messages.append({"role": "user", "content": text})
        answer, reasoning, pieces, reason, stop_string = [], [], 0, "eos", None
        try:
            for step in reply:
                kind = step[0]
                if kind in ("text", "reasoning"):
                    for piece in _pieces(step[1]):
                        time.sleep(self.delay)
                        (answer if kind == "text" else reasoning).append(piece)
                        pieces += 1
                        yield TextDelta(piece) if kind == "text" else ReasoningDelta(piece)
                        if cancel.is_set():
                            break
                elif kind == "notice":
                    yield Notice(step[1])
                elif kind == "hang":
                    self.hanging.set()
                    cancel.wait(HANG_LIMIT_S)
                    reason = "cancelled"
                    break
                elif kind == "fail":
                    raise FerrumError(step[1])
                elif kind == "end":
                    reason, stop_string = step[1], (step[2] if len(step) > 2 else None)
                    break
        finally:
            message = {"role": "assistant", "content": "".join(answer)}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            conv.messages.append(message)
            conv.ledger = list(range(TOKENS_PER_MESSAGE * len(conv.messages) + pieces))
            self._cancel = None
        yield Done(
            reason,
            prompt_tokens=12,
            cached_tokens=0,
            generated_tokens=pieces,
            ttft_s=0.25,
            prefill_tps=48.0,
            decode_tps=42.0,
            stop_string=stop_string,
        )


def _pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


class FakeServices(Services):
    def __init__(self, engine: FakeEngine, models=("fake-model:1b", "qwen3:0.6b")):
        super().__init__("auto")
        self.engine = engine
        self.models = [ModelEntry(m, "1.0 GB  gguf Q4_1") for m in models]
        self.opened_names: list[str | None] = []
        self.pulled: list[str] = []

    def open_engine(self, name):
        self.opened_names.append(name)
        self.engine.name = name or self.engine.name
        return self.engine

    def local_models(self):
        return list(self.models)

    def pull(self, name, progress):
        progress.start(f"pulling {name}", [("model.gguf", 1000, 0)])
        progress.file_started("model.gguf", 1000, 0)
        for _ in range(10):
            time.sleep(0.01)
            progress.advance(100)
        progress.file_done("model.gguf")
        progress.stop()
        self.pulled.append(name)
        self.models.append(ModelEntry(name, "0.1 GB  gguf Q8_0"))

    def backend_and_device(self) -> str:
        return "fake · cpu"

    def memory_bytes(self) -> int:
        return 1_234_567_890
