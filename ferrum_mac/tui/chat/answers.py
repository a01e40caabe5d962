"""The answer on the chat screen: a turn queued on the engine thread, then its chunks, notices, end or failure.

Each turn sets the engine conversation's messages from the history first; the engine
conversation keeps its KV cache while it stays resident, so a turn prefills only what changed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ferrum_mac.errors import FerrumError
from ferrum_mac.tui import tool_turn
from ferrum_mac.tui.attachments import split_message
from ferrum_mac.tui.chat_settings import stored_settings
from ferrum_mac.tui.chat_turn import run_turn
from ferrum_mac.tui.messages import AnswerChunk, AnswerDone
from ferrum_mac.tui.token_count import count_tokens
from ferrum_mac.tui.widgets.message_list import MessageList
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.notice_line import NoticeLine

if TYPE_CHECKING:
    from ferrum_mac.tui.screens.chat_screen import ChatScreen

TITLE_CHARS = 40
SHOWN_ROLES = ("user", "assistant")
STOP_REASONS = {
    "max_tokens": "cut at max tokens",
    "context": "context full (Ctrl+N starts afresh; FERRUM_KV_CAPACITY sets its size)",
    "cancelled": "stopped by you",
    "loop": "stopped: it kept repeating itself",
    "error": "stopped by an error",
}


class Answers:
    """The answer being streamed (at most one): started, shown as it comes, saved when it ends."""

    def __init__(self, screen: ChatScreen):
        self.screen = screen
        self.view: MessageView | None = None  # the answer being streamed
        self.cancel_event: threading.Event | None = None
        self.tool_calls: tuple = ()  # the calls of the answer being streamed
        self.turn_context = 0  # tokens held before the answer being streamed: earlier turns and the new message

    @property
    def busy(self) -> bool:
        return self.view is not None

    @property
    def history(self):
        return self.screen.history

    # -- starting a turn ----------------------------------------------------------------------

    async def send(self, text: str, resend: bool = False, attachments: list[dict] | None = None) -> None:
        """Save `text` as the next user message and start the answer in a worker thread;
        `resend`: `text` is the last message shown already (regenerate its answer);
        `attachments`: what `text` carries after the typed part, for its chips."""
        screen, conversations = self.screen, self.screen.conversations
        if screen.current_id is None:
            title = title_from(split_message(text)[0] or attachments[0]["name"] if attachments else text)
            conversations.create(title, stored_settings(screen.app.default_settings))
        try:
            settings, draft = screen.chat_settings.for_turn()
        except FerrumError as e:
            screen.notify(str(e), severity="error")
            return
        path = self.history.messages(screen.current_id)
        earlier = engine_messages(path[:-1] if resend else path)
        messages = screen.query_one(MessageList)
        if not messages.shows_the_end:  # opened at a search hit far back: the new turn goes at the end
            await conversations.open(screen.current_id)
        if not resend:
            stats = {"attachments": attachments} if attachments else None
            user = self.history.add_message(screen.current_id, "user", text, stats=stats)
            for welcome in screen.query("#welcome"):
                await welcome.remove()
            await messages.add(conversations.message_widget(user))
        await self.show_new_answer()
        await conversations.refresh_sidebar()
        conv = self.resident_conversation(settings, draft)
        self.start(conv, earlier, text, screen.figures.context_used() + count_tokens(screen.app.engine, text))

    async def continue_after_tools(self) -> None:
        """Stream the model's answer to the tool results the conversation now ends with."""
        settings, draft = self.screen.chat_settings.for_turn()
        earlier = engine_messages(self.history.messages(self.screen.current_id))
        await self.show_new_answer()
        conv = self.resident_conversation(settings, draft)
        self.start(conv, earlier, None, self.screen.figures.context_used())

    async def regenerate(self) -> None:
        chat_id = self.screen.current_id
        if self.screen.refuse_while_busy() or chat_id is None:
            return
        users = [m for m in self.history.messages(chat_id) if m.role == "user"]
        if not users:
            return
        self.history.set_leaf(chat_id, users[-1].id)  # the old answer stays, as a branch
        await self.screen.conversations.open(chat_id)
        await self.send(users[-1].content, resend=True)

    async def show_new_answer(self) -> None:
        """An empty answer at the end of the messages, which follow it as it grows."""
        self.view = MessageView("assistant", show_reasoning=self.screen.conversations.show_reasoning)
        messages = self.screen.query_one(MessageList)
        await messages.add(self.view)
        messages.anchor()

    def resident_conversation(self, settings, draft: str | None):
        """The current chat's engine conversation with `settings`; `draft` (a draft model's name)
        is loaded on the engine thread first, so the turn queued after it speculates with it."""
        app, chat_id = self.screen.app, self.screen.current_id
        conv = app.resident.get(chat_id, settings)
        if draft is not None:
            app.engine_thread.run(app.drafts.load_into, conv, draft, chat_id, self.screen.post_message)
        return conv

    def start(self, conv, earlier: list[dict], text: str | None, turn_context: int) -> None:
        """Queue the turn on the engine thread (`text` None: the answer to the tool results)."""
        self.turn_context = turn_context
        self.cancel_event = threading.Event()
        tools = tool_turn.registered_tools()
        post = self.screen.post_message
        self.screen.app.engine_thread.run(run_turn, conv, earlier, text, self.cancel_event, post, tools)

    def stop(self) -> None:
        self.cancel_event.set()
        self.screen.app.engine.cancel()

    # -- what the turn reports ----------------------------------------------------------------

    def calls_requested(self, calls: tuple) -> None:
        self.tool_calls = calls  # run once the answer is saved (done)

    async def add_chunk(self, event: AnswerChunk) -> None:
        if self.view is not None:
            await self.view.append(event.text, event.reasoning)
            self.screen.figures.show_streaming(event, self.turn_context)

    async def notice(self, text: str) -> None:
        if self.screen.current_id is not None:
            self.history.add_message(self.screen.current_id, "notice", text)
        await self.insert_before_answer(NoticeLine(text))

    async def done(self, event: AnswerDone) -> None:
        if self.view is None:
            return
        stats = {**event.stats, "context_used": event.context_used}
        saved = self.history.add_message(self.screen.current_id, "assistant", event.content, event.reasoning, stats)
        await self.view.finish(event.content, event.reasoning, answer_footer(stats), saved.id)
        self.view.set_branch(saved.branch)
        self.ended()
        calls, self.tool_calls = self.tool_calls, ()
        tools = tool_turn.registered_tools()
        if calls and tools is not None:
            self.screen.run_worker(tool_turn.handle_calls(self.screen, calls, tools))

    async def failed(self, error: str) -> None:
        if self.view is None:
            return
        answer, chat_id = self.view, self.screen.current_id
        if answer.content or answer.reasoning:  # keep what was shown
            saved = self.history.add_message(
                chat_id, "assistant", answer.content, answer.reasoning, {"stop_reason": "error"}
            )
            await answer.finish(answer.content, answer.reasoning, "stopped by an error", saved.id)
        else:
            await answer.remove()
        self.history.add_message(chat_id, "error", f"error: {error}")
        await self.screen.query_one(MessageList).add(NoticeLine(f"error: {error}", error=True))
        self.ended()

    async def insert_before_answer(self, widget) -> None:
        messages = self.screen.query_one(MessageList)
        if self.view is not None and self.view.parent is messages:
            await messages.mount(widget, before=self.view)
        else:
            await messages.add(widget)

    def ended(self) -> None:
        self.view = None
        self.cancel_event = None
        self.screen.refresh_status()


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def engine_messages(stored) -> list[dict]:
    """The chat's messages as the engine takes them (notices and errors are not sent)."""
    messages: list[dict] = []
    for m in stored:
        if m.role in tool_turn.TOOL_ROLES:
            tool_turn.add_tool_row(messages, m)
        elif m.role in SHOWN_ROLES:
            message = {"role": m.role, "content": m.content}
            if m.reasoning:
                message["reasoning_content"] = m.reasoning
            messages.append(message)
    return messages


def answer_footer(stats: dict) -> str:
    """An answer's cost: tokens, speed, time to the first token, prompt tokens taken from the KV
    cache rather than computed, speculation's acceptance, and why it ended (unless it simply did)."""
    if not stats:
        return ""
    parts = []
    if stats.get("generated_tokens"):
        parts.append(f"{stats['generated_tokens']} tokens")
    if stats.get("decode_tps"):
        parts.append(f"{stats['decode_tps']:.1f} tok/s")
    if stats.get("ttft_s"):
        parts.append(f"first token {stats['ttft_s']:.2f} s")
    if stats.get("cached_tokens"):  # none: the whole prompt was computed
        parts.append(f"{stats['cached_tokens']} cached")
    speculation = stats.get("speculation")
    if isinstance(speculation, dict) and speculation.get("proposed"):
        parts.append(f"guessed {speculation['proposed']}, kept {speculation.get('accepted', 0)}")
    reason = stats.get("stop_reason")
    if reason == "stop":
        parts.append(f"stop string {stats['stop_string']!r}" if stats.get("stop_string") else "stop string")
    elif reason and reason != "eos":
        parts.append(STOP_REASONS.get(reason, reason))
    return " · ".join(parts)
