"""The main screen: the sidebar of conversations, the messages, the prompt and the status bar.

The history (sqlite) is the record: each message is written as it completes, and before
each turn the engine conversation's messages are set from it. The engine conversation keeps
its KV cache while it stays resident, so a turn prefills only what changed.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, Static

from ferrum_mac.errors import FerrumError
from ferrum_mac.tui.attachments import at_paths, message_text, read_attachment, split_message
from ferrum_mac.tui.chat_settings import engine_settings, stored_settings, wanted_draft
from ferrum_mac.tui import tool_turn
from ferrum_mac.tui.chat_turn import run_turn
from ferrum_mac.tui.token_count import count_tokens
from ferrum_mac.tui.messages import (
    AnswerChunk,
    AnswerDone,
    AnswerFailed,
    AnswerNotice,
    AttachmentsChanged,
    BranchRequested,
    ConversationChosen,
    CopyRequested,
    DraftFailed,
    DraftOpened,
    EditRequested,
    PromptSubmitted,
    SearchChanged,
)
from ferrum_mac.tui.widgets.attachment_chips import AttachmentChips, chip_text
from ferrum_mac.tui.widgets.conversation_list import ConversationList
from ferrum_mac.tui.widgets.message_list import MessageList
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.notice_line import NoticeLine
from ferrum_mac.tui.widgets.prompt_input import PromptInput
from ferrum_mac.tui.widgets.status_bar import StatusBar

NEW_TITLE = "New chat"
TITLE_CHARS = 40
WELCOME = "Ask anything.  Enter sends · Shift+Enter or Ctrl+J for a new line · F1 for help"
SHOWN_ROLES = ("user", "assistant")
STATUS_SECONDS = 0.5  # the status bar's figures change at most this often while an answer streams
NOTICE_ROLES = ("notice", "error")


class ChatScreen(Screen):
    CSS_PATH = "chat_screen.tcss"
    # The footer shows what fits beside the palette key at 80 columns, Help and the app's Quit included;
    # the rest is on the help screen (F1) and in the command palette.
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False, priority=True),
        Binding("ctrl+t", "toggle_reasoning", "Reasoning", show=False, priority=True),
        Binding("ctrl+s", "settings", "Settings", priority=True),
        Binding("ctrl+f", "search", "Search", show=False, priority=True),
        Binding("ctrl+o", "attach", "Attach", show=False, priority=True),
        Binding("ctrl+l", "toggle_list", "Chats", show=False, priority=True),
        Binding("ctrl+up", "last_message", "Messages", show=False, priority=True),
        Binding("f2", "rename", "Rename", show=False),
        Binding("f3", "export", "Export", show=False),
        Binding("f4", "pick_model", "Model"),
        Binding("f1", "help", "Help"),
    ]

    def __init__(self):
        super().__init__()
        self.current_id: int | None = None
        self.search_text = ""
        self.answer: MessageView | None = None  # the answer being streamed
        self.cancel_event: threading.Event | None = None
        self.editing_id: int | None = None  # the user message being edited, if any
        self.show_reasoning = False
        self.status_shown = 0.0  # when the streaming figures were last shown
        self.tool_calls: tuple = ()  # the calls of the answer being streamed
        self.pending_tokens = 0  # what the prompt's attachments will add to the context
        self.turn_context = 0  # tokens held before the answer being streamed: earlier turns and the new message

    @property
    def history(self):
        return self.app.history

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield ConversationList(id="sidebar")
            with Vertical(id="chat"):
                yield MessageList(id="messages")
                yield Label("", id="editing", markup=False)
                yield AttachmentChips(id="attachments")
                yield PromptInput(id="prompt")
        yield StatusBar(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#editing").display = False
        self.query_one("#attachments").display = False
        conversations = self.history.conversations()
        first = self.app.open_id or (conversations[0].id if conversations else None)
        await self.open_conversation(first)
        self.query_one(PromptInput).focus()

    # -- what is shown ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.answer is not None

    async def open_conversation(self, conversation_id: int | None, at_message: int | None = None) -> None:
        self.current_id = conversation_id
        self.end_editing()
        messages = self.history.messages(conversation_id) if conversation_id else []
        shown = self.query_one(MessageList)
        if messages:
            around = next((i for i, m in enumerate(messages) if m.id == at_message), None)
            await shown.show_stored(messages, self.message_widget, around)
        else:
            await shown.show_messages([Static(WELCOME, id="welcome")])
        await self.refresh_sidebar()
        self.refresh_status()
        if at_message is not None:
            self.call_after_refresh(self.focus_message, at_message)

    def message_widget(self, m):
        if m.role in tool_turn.TOOL_ROLES:
            return tool_turn.tool_widget(m)
        if m.role in NOTICE_ROLES:
            return NoticeLine(m.content, error=m.role == "error")
        return MessageView(
            m.role,
            m.content,
            m.reasoning,
            message_id=m.id,
            show_reasoning=self.show_reasoning,
            footer=answer_footer(m.stats) if m.role == "assistant" else "",
            branch=m.branch,
            attachments=bool(m.stats.get("attachments")),
        )

    async def refresh_sidebar(self) -> None:
        await self.query_one(ConversationList).show(self.history.conversations(self.search_text), self.current_id)

    def refresh_status(self) -> None:
        try:
            self._refresh_status()
        except NoMatches:  # the app is closing, its widgets going; the timer fired late
            pass

    def _refresh_status(self) -> None:
        status = self.query_one(StatusBar)
        app = self.app
        status.show_model(app.model_name, app.device_text)
        if not self.busy:  # while an answer streams, its own figures are shown (show_streaming)
            stats = self.last_answer_stats()
            status.show_speed(stats.get("decode_tps"))
            status.show_context(stats.get("context_used", 0), self.capacity(), self.pending_tokens)
        status.show_memory(app.memory_text())

    def capacity(self) -> int:
        engine = self.app.engine
        return (engine.kv_capacity() or 0) if engine is not None else 0  # a remote may not say

    def context_used(self) -> int:
        return self.last_answer_stats().get("context_used", 0)

    def last_answer_stats(self) -> dict:
        if self.current_id is None:
            return {}
        answers = [m for m in self.history.messages(self.current_id) if m.role == "assistant"]
        return answers[-1].stats if answers else {}

    # -- sending ------------------------------------------------------------------------------

    @on(PromptSubmitted)
    async def _submitted(self, event: PromptSubmitted) -> None:
        if self.busy:
            self.notify("Still answering; Esc stops the answer.", severity="warning")
            return
        if self.app.engine is None:
            self.notify("The model is still loading.", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        try:
            attached = [read_attachment(path, Path.cwd()) for path in at_paths(event.text, Path.cwd())]
        except FerrumError as e:
            self.notify(str(e), severity="error", timeout=10)
            return
        attachments = prompt.attachments + attached
        text = message_text(event.text, attachments)
        if not self.fits(text):
            return
        if self.editing_id is not None:
            await self.branch_before(self.editing_id)
        prompt.clear()
        prompt.take_attachments()
        await self.send(text, attachments=[a.described() for a in attachments])

    def fits(self, text: str) -> bool:
        """Whether the message alone fits the context; if not, say so (nothing is sent)."""
        tokens, capacity = count_tokens(self.app.engine, text), self.capacity()
        if capacity and tokens >= capacity:
            self.notify(
                f"This message is {tokens} tokens and the context holds {capacity}: attach less.",
                severity="error",
                timeout=10,
            )
            return False
        return True

    async def branch_before(self, message_id: int) -> None:
        """Show the path up to message `message_id`'s parent: what is sent next goes beside it."""
        [parent] = [m.parent_id for m in self.history.messages(self.current_id) if m.id == message_id]
        self.history.set_leaf(self.current_id, parent)
        self.end_editing()
        await self.open_conversation(self.current_id)

    async def send(self, text: str, resend: bool = False, attachments: list[dict] | None = None) -> None:
        """Save `text` as the next user message and start the answer in a worker thread;
        `resend`: `text` is the last message shown already (regenerate its answer);
        `attachments`: what `text` carries after the typed part, for its chips."""
        if self.current_id is None:
            title = title_from(split_message(text)[0] or attachments[0]["name"] if attachments else text)
            chat = self.history.new_conversation(title, stored_settings(self.app.default_settings))
            self.current_id = chat.id
        try:
            settings, draft = self.turn_settings()
        except FerrumError as e:
            self.notify(str(e), severity="error")
            return
        path = self.history.messages(self.current_id)
        earlier = engine_messages(path[:-1] if resend else path)
        messages = self.query_one(MessageList)
        if not messages.shows_the_end:  # opened at a search hit far back: the new turn goes at the end
            await self.open_conversation(self.current_id)
        if not resend:
            stats = {"attachments": attachments} if attachments else None
            user = self.history.add_message(self.current_id, "user", text, stats=stats)
            for welcome in self.query("#welcome"):
                await welcome.remove()
            await messages.add(self.message_widget(user))
        self.answer = MessageView("assistant", show_reasoning=self.show_reasoning)
        await messages.add(self.answer)
        messages.anchor()
        await self.refresh_sidebar()
        conv = self.resident_conversation(settings, draft)
        self.turn_context = self.context_used() + count_tokens(self.app.engine, text)
        self.cancel_event = threading.Event()
        tools = tool_turn.registered_tools()
        self.app.engine_thread.run(run_turn, conv, earlier, text, self.cancel_event, self.post_message, tools)

    async def continue_after_tools(self) -> None:
        """Stream the model's answer to the tool results the conversation now ends with."""
        settings, draft = self.turn_settings()
        earlier = engine_messages(self.history.messages(self.current_id))
        self.answer = MessageView("assistant", show_reasoning=self.show_reasoning)
        messages = self.query_one(MessageList)
        await messages.add(self.answer)
        messages.anchor()
        conv = self.resident_conversation(settings, draft)
        self.turn_context = self.context_used()
        self.cancel_event = threading.Event()
        tools = tool_turn.registered_tools()
        self.app.engine_thread.run(run_turn, conv, earlier, None, self.cancel_event, self.post_message, tools)

    def turn_settings(self):
        """The current chat's engine settings, and the draft model they name that is not loaded
        yet (None: none): the turn speculates with auto until it is."""
        stored = self.history.conversation(self.current_id).settings
        name = wanted_draft(stored)
        draft = self.app.drafts.loaded(self.app.engine, name) if name else None
        return engine_settings(self.app.engine, stored, draft), (name if name and draft is None else None)

    def resident_conversation(self, settings, draft: str | None):
        """The current chat's engine conversation with `settings`; `draft` (a draft model's name)
        is loaded on the engine thread first, so the turn queued after it speculates with it."""
        conv = self.app.resident.get(self.current_id, settings)
        if draft is not None:
            self.app.engine_thread.run(self.app.drafts.load_into, conv, draft, self.current_id, self.post_message)
        return conv

    def on_tool_calls_requested(self, event: tool_turn.ToolCallsRequested) -> None:
        self.tool_calls = event.calls  # run once the answer is saved (on_answer_done)

    async def on_answer_chunk(self, event: AnswerChunk) -> None:
        if self.answer is not None:
            await self.answer.append(event.text, event.reasoning)
            self.show_streaming(event)

    def show_streaming(self, event: AnswerChunk) -> None:
        """The answer's tokens and speed so far in the status bar, at most every STATUS_SECONDS."""
        now = time.monotonic()
        if now - self.status_shown >= STATUS_SECONDS:
            self.status_shown = now
            status = self.query_one(StatusBar)
            status.show_streaming(event.pieces, event.pieces_per_second)
            status.show_context(self.turn_context + event.pieces, self.capacity())

    async def on_answer_notice(self, event: AnswerNotice) -> None:
        if self.current_id is not None:
            self.history.add_message(self.current_id, "notice", event.text)
        await self.insert_before_answer(NoticeLine(event.text))

    async def on_answer_done(self, event: AnswerDone) -> None:
        if self.answer is None:
            return
        stats = {**event.stats, "context_used": event.context_used}
        saved = self.history.add_message(self.current_id, "assistant", event.content, event.reasoning, stats)
        await self.answer.finish(event.content, event.reasoning, answer_footer(stats), saved.id)
        self.answer.set_branch(saved.branch)
        self.turn_ended()
        calls, self.tool_calls = self.tool_calls, ()
        tools = tool_turn.registered_tools()
        if calls and tools is not None:
            self.run_worker(tool_turn.handle_calls(self, calls, tools))

    async def on_answer_failed(self, event: AnswerFailed) -> None:
        if self.answer is None:
            return
        answer = self.answer
        if answer.content or answer.reasoning:  # keep what was shown
            saved = self.history.add_message(
                self.current_id, "assistant", answer.content, answer.reasoning, {"stop_reason": "error"}
            )
            await answer.finish(answer.content, answer.reasoning, "stopped by an error", saved.id)
        else:
            await answer.remove()
        self.history.add_message(self.current_id, "error", f"error: {event.error}")
        await self.query_one(MessageList).add(NoticeLine(f"error: {event.error}", error=True))
        self.turn_ended()

    async def insert_before_answer(self, widget) -> None:
        messages = self.query_one(MessageList)
        if self.answer is not None and self.answer.parent is messages:
            await messages.mount(widget, before=self.answer)
        else:
            await messages.add(widget)

    def turn_ended(self) -> None:
        self.answer = None
        self.cancel_event = None
        self.refresh_status()

    # -- actions ------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.busy:
            self.cancel_event.set()
            self.app.engine.cancel()
        elif self.editing_id is not None:
            self.end_editing()
            self.query_one(PromptInput).clear()

    async def action_new_chat(self) -> None:
        if self.refuse_while_busy():
            return
        await self.open_conversation(None)
        self.query_one(PromptInput).focus()

    async def action_regenerate(self) -> None:
        if self.refuse_while_busy() or self.current_id is None:
            return
        users = [m for m in self.history.messages(self.current_id) if m.role == "user"]
        if not users:
            return
        self.history.set_leaf(self.current_id, users[-1].id)  # the old answer stays, as a branch
        await self.open_conversation(self.current_id)
        await self.send(users[-1].content, resend=True)

    def action_toggle_reasoning(self) -> None:
        self.show_reasoning = not self.show_reasoning
        for view in self.query(MessageView):
            view.set_reasoning_shown(self.show_reasoning)

    def action_settings(self) -> None:
        from ferrum_mac.tui.screens.settings_screen import SettingsScreen

        if self.current_id is None:
            title, settings = NEW_TITLE, stored_settings(self.app.default_settings)
        else:
            chat = self.history.conversation(self.current_id)
            title, settings = chat.title, stored_settings(chat.settings)
        engine = self.app.engine
        find_drafts = partial(self.app.services.draft_models, engine) if engine is not None else None
        self.app.push_screen(
            SettingsScreen(title, settings, find_drafts, defaults_in_force(engine)), self.settings_saved
        )

    async def settings_saved(self, settings: dict | None) -> None:
        if settings is None:
            return
        if self.current_id is None:
            self.app.default_settings = settings
        else:
            self.history.save_settings(self.current_id, settings)
        self.notify("Settings saved.")
        self.load_draft(settings)

    def load_draft(self, settings: dict) -> None:
        """Load the draft model `settings` name now, off the UI thread, so a bad one is said at once."""
        name, engine = wanted_draft(settings), self.app.engine
        if name and engine is not None and self.app.drafts.loaded(engine, name) is None:
            self.notify(f"Loading the draft model {name}…")
            self.app.engine_thread.run(self.app.drafts.load, engine, name, self.current_id, self.post_message)

    def on_draft_opened(self, event: DraftOpened) -> None:
        self.notify(f"Draft model {event.name} loaded: answers guess ahead with it.")

    def on_draft_failed(self, event: DraftFailed) -> None:
        """Say why, and fall back to auto where the settings still name that draft."""
        self.notify(
            f"Draft model {event.name}: {event.error.rstrip('.')}. Speculation is back to auto.",
            severity="error",
            timeout=15,
        )
        word = f"draft:{event.name}"
        if event.chat_id is None:
            if self.app.default_settings.get("speculate") == word:
                self.app.default_settings = stored_settings(self.app.default_settings, speculate=None)
            return
        try:
            stored = self.history.conversation(event.chat_id).settings
        except FerrumError:  # deleted while the draft loaded
            return
        if stored.get("speculate") == word:
            self.history.save_settings(event.chat_id, stored_settings(stored, speculate=None))

    def action_search(self) -> None:
        from ferrum_mac.tui.screens.search_screen import SearchScreen

        self.app.push_screen(SearchScreen(self.history), self.search_chosen)

    async def search_chosen(self, hit) -> None:
        if hit is None or self.refuse_while_busy():
            return
        self.history.show_message(hit.conversation_id, hit.message_id)  # it may be on another branch
        await self.open_conversation(hit.conversation_id, at_message=hit.message_id)

    def focus_message(self, message_id: int) -> None:
        for view in self.query(MessageView):
            if view.message_id == message_id:
                view.focus()  # focusing scrolls it into view
                return

    def action_attach(self) -> None:
        from ferrum_mac.tui.screens.text_prompt_screen import PathPromptScreen

        question = "Attach a text file: its path (Tab completes it; or type @path in the prompt)"
        self.app.push_screen(PathPromptScreen(question), self.attach_path)

    def attach_path(self, path: str | None) -> None:
        if not path:
            return
        try:
            attachment = read_attachment(path, Path.cwd())
        except FerrumError as e:
            self.notify(str(e), severity="error", timeout=10)
            return
        prompt = self.query_one(PromptInput)
        prompt.attach(attachment)
        prompt.focus()

    @on(AttachmentsChanged)
    async def _attachments_changed(self, event: AttachmentsChanged) -> None:
        """Chips above the prompt, each with its cost, and the context meter with what they add."""
        engine = self.app.engine
        costs = [count_tokens(engine, a.block()) for a in event.attachments]
        chips = [chip_text(a.name, a.lines, cost) for a, cost in zip(event.attachments, costs)]
        await self.query_one(AttachmentChips).show(chips)
        self.pending_tokens = sum(costs)
        if not self.busy:
            self.query_one(StatusBar).show_context(self.context_used(), self.capacity(), self.pending_tokens)

    def action_toggle_list(self) -> None:
        """One key to the conversation list, and the same key back to the prompt."""
        conversations = self.query_one("#conversations")
        if conversations.has_focus:
            self.query_one(PromptInput).focus()
        else:
            conversations.focus()

    def action_last_message(self) -> None:
        views = self.query_one(MessageList).message_views()
        if views:
            views[-1].focus()

    async def focus_next_message(self, view: MessageView, step: int) -> None:
        shown = self.query_one(MessageList)
        views = shown.message_views()
        place = views.index(view) + step
        if not 0 <= place < len(views) and (shown.first if step < 0 else not shown.shows_the_end):
            await shown.load_more(earlier=step < 0)  # the window's edge: mount the next one
            views = shown.message_views()
            place = views.index(view) + step
        if 0 <= place < len(views):
            views[place].focus()
        elif step > 0:
            self.query_one(PromptInput).focus()

    def action_rename(self) -> None:
        from ferrum_mac.tui.screens.text_prompt_screen import TextPromptScreen

        chat_id = self.current_id
        if chat_id is None:
            return
        title = self.history.conversation(chat_id).title
        self.app.push_screen(TextPromptScreen("Rename the conversation", title), partial(self.renamed, chat_id))

    async def renamed(self, chat_id: int, title: str | None) -> None:
        if title:
            self.history.rename(chat_id, title)
            await self.refresh_sidebar()

    def action_delete_chat(self) -> None:
        from ferrum_mac.tui.screens.confirm_screen import ConfirmScreen

        chat_id = self.query_one(ConversationList).highlighted_id() or self.current_id
        if chat_id is None or self.refuse_while_busy():
            return
        title = self.history.conversation(chat_id).title
        self.app.push_screen(ConfirmScreen(f"Delete “{title}” and its messages?"), partial(self.deleted, chat_id))

    async def deleted(self, chat_id: int, yes: bool | None) -> None:
        if not yes:
            return
        self.app.resident.release(chat_id)
        self.history.delete(chat_id)
        if chat_id == self.current_id:
            remaining = self.history.conversations()
            await self.open_conversation(remaining[0].id if remaining else None)
        else:
            await self.refresh_sidebar()

    def action_export(self) -> None:
        from ferrum_mac.tui.export import conversation_markdown, export_path

        if self.current_id is None:
            self.notify("Nothing to export yet.")
            return
        chat = self.history.conversation(self.current_id)
        try:
            self.app.export_dir.mkdir(parents=True, exist_ok=True)
            path = export_path(self.app.export_dir, chat.title)
            path.write_text(conversation_markdown(chat.title, self.history.messages(self.current_id)), encoding="utf-8")
        except OSError as e:
            self.notify(f"Cannot export to {self.app.export_dir}: {e.strerror or e}", severity="error", timeout=15)
            return
        self.notify(f"Exported to {path.resolve()}", timeout=15)

    def action_pick_model(self) -> None:
        from ferrum_mac.tui.screens.model_picker import ModelPicker

        if self.refuse_while_busy():
            return
        self.app.push_screen(ModelPicker(self.app.services, self.app.model_name), self.model_picked)

    def model_picked(self, name: str | None) -> None:
        if name and name != self.app.model_name:
            self.app.switch_model(name)

    def action_help(self) -> None:
        from ferrum_mac.tui.screens.help_screen import HelpScreen

        self.app.push_screen(HelpScreen())

    def action_copy_last_answer(self) -> None:
        answers = [v for v in self.query(MessageView) if v.role == "assistant"]
        if answers:
            self.copy(answers[-1].content, "answer")

    def refuse_while_busy(self) -> bool:
        if self.busy:
            self.notify("Still answering; Esc stops the answer first.", severity="warning")
        return self.busy

    # -- requests from widgets ----------------------------------------------------------------

    @on(ConversationChosen)
    async def _chosen(self, event: ConversationChosen) -> None:
        if event.conversation_id != self.current_id and not self.refuse_while_busy():
            await self.open_conversation(event.conversation_id)

    @on(BranchRequested)
    async def _branch(self, event: BranchRequested) -> None:
        if self.refuse_while_busy() or self.current_id is None:
            return
        shown = self.history.switch_branch(self.current_id, event.message_id, event.step)
        if shown is not None:  # the next turn sends this path; the prefix cache holds what it shares
            await self.open_conversation(self.current_id, at_message=shown)

    @on(SearchChanged)
    async def _search_changed(self, event: SearchChanged) -> None:
        self.search_text = event.text
        await self.refresh_sidebar()

    @on(CopyRequested)
    def _copy(self, event: CopyRequested) -> None:
        self.copy(event.text, event.what)

    @on(EditRequested)
    def _edit(self, event: EditRequested) -> None:
        if self.refuse_while_busy():
            return
        self.editing_id = event.message_id
        prompt = self.query_one(PromptInput)
        typed, attachments = split_message(event.text)
        prompt.text = typed
        prompt.take_attachments()
        for attachment in attachments:
            prompt.attach(attachment)
        prompt.focus()
        hint = self.query_one("#editing", Label)
        hint.update("Editing an earlier message: Enter resends it as a new branch (← → switch), Esc cancels")
        hint.display = True

    def end_editing(self) -> None:
        self.editing_id = None
        self.query_one("#editing").display = False

    def copy(self, text: str, what: str) -> None:
        from ferrum_mac.tui.clipboard import copy_text

        self.notify(copy_text(self.app, text, what, self.app.export_dir), timeout=8)


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


STOP_REASONS = {
    "max_tokens": "cut at max tokens",
    "context": "context full (Ctrl+N starts afresh; FERRUM_KV_CAPACITY sets its size)",
    "cancelled": "stopped by you",
    "error": "stopped by an error",
}


def defaults_in_force(engine) -> dict:
    """The model's defaults the settings dialog shows in its empty fields ({} before it loads)."""
    if engine is None:
        return {}
    settings = engine.settings()
    return {
        "temperature": settings.sampling.temperature,
        "top_p": settings.sampling.top_p,
        "max_tokens": settings.max_tokens,
    }


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
