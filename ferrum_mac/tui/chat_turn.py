"""One answer, run in a worker thread: engine events become batched UI messages.

Text is posted at most every `BATCH_SECONDS` (never one message per token), so the Markdown
widget re-renders ~20 times a second however fast the model decodes.
"""

from __future__ import annotations

import threading
import time

from ferrum_mac.engine import Done, Notice, ReasoningDelta, TextDelta, ToolCallRequested
from ferrum_mac.tui.messages import AnswerChunk, AnswerDone, AnswerFailed, AnswerNotice
from ferrum_mac.tui.tool_turn import ToolCallsRequested, answer_events

BATCH_SECONDS = 0.05


class Batcher:
    """Collects deltas and posts them at most every BATCH_SECONDS; a timer posts what is left
    when the model pauses, so no text waits for the next token."""

    def __init__(self, post):
        self.post = post
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.last = 0.0
        self.pieces = 0  # deltas so far, for the live speed in the status bar
        self.first = 0.0  # when the first came
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def add(self, text: str = "", reasoning: str = "") -> None:
        with self.lock:
            self.text.append(text)
            self.reasoning.append(reasoning)
            self.pieces += 1
            self.first = self.first or time.monotonic()
            wait = self.last + BATCH_SECONDS - time.monotonic()
            if wait > 0:
                if self.timer is None:
                    self.timer = threading.Timer(wait, self.flush)
                    self.timer.daemon = True
                    self.timer.start()
                return
        self.flush()

    def flush(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            text, reasoning = "".join(self.text), "".join(self.reasoning)
            self.text, self.reasoning = [], []
            self.last = time.monotonic()
            if text or reasoning:
                self.post(AnswerChunk(text, reasoning, self.pieces, self.rate()))

    def rate(self) -> float:
        """Pieces a second after the first (which waited for the prompt), as the engine counts decode speed."""
        elapsed = time.monotonic() - self.first
        return (self.pieces - 1) / elapsed if self.pieces > 1 and elapsed > 0 else 0.0


def context_used(conv, done: Done) -> int:
    """Tokens the conversation holds after the answer: the cache's ledger where the engine is local,
    else what the server counted (a remote engine keeps no ledger): prompt, cached and answer."""
    return len(conv.ledger) or done.prompt_tokens + done.cached_tokens + done.generated_tokens


def run_turn(conv, history: list[dict], text: str | None, cancel: threading.Event, post, tools=None) -> None:
    """Answer `text` after `history` (the chat's earlier messages, as the engine takes them).

    The conversation's messages are set to `history` first: the engine keeps the cache's
    common prefix with the new prompt and prefills the rest (an edited or regenerated turn
    truncates the cache to where it changed). `tools`: what the model may call (a `Toolbox`);
    `text` None: the answer to the tool results `history` ends with.
    """
    batch = Batcher(post)
    try:
        conv.messages = list(history)
        for event in answer_events(conv, text, cancel, tools):
            if isinstance(event, TextDelta):
                batch.add(text=event.text)
            elif isinstance(event, ReasoningDelta):
                batch.add(reasoning=event.text)
            elif isinstance(event, Notice):
                batch.flush()
                post(AnswerNotice(event.text))
            elif isinstance(event, ToolCallRequested):
                post(ToolCallsRequested(event.calls))
            elif isinstance(event, Done):
                batch.flush()
                answer = conv.messages[-1]
                post(
                    AnswerDone(
                        answer["content"],
                        answer.get("reasoning_content", ""),
                        event.as_dict(),
                        context_used(conv, event),
                    )
                )
    except Exception as e:  # the UI shows it in the conversation; the app keeps running
        batch.flush()
        post(AnswerFailed(str(e).splitlines()[0] if str(e) else type(e).__name__))
