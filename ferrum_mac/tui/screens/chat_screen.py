"""The main screen: the sidebar of conversations, the messages, the prompt and the status bar.

The screen holds the widgets, the key bindings and the message handlers; each job is a
collaborator in `ferrum_mac.tui.chat` that the handlers delegate to: the conversations shown
(`Conversations`), the answer being streamed (`Answers`), the message being written
(`Composer`), the settings its turns run with (`TurnSettings`) and the status bar's figures
(`StatusFigures`).
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label

from ferrum_mac.tui import tool_turn
from ferrum_mac.tui.chat.answers import Answers
from ferrum_mac.tui.chat.composer import Composer
from ferrum_mac.tui.chat.conversations import Conversations
from ferrum_mac.tui.chat.status_figures import StatusFigures
from ferrum_mac.tui.chat.turn_settings import TurnSettings
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
from ferrum_mac.tui.widgets.attachment_chips import AttachmentChips
from ferrum_mac.tui.widgets.conversation_list import ConversationList
from ferrum_mac.tui.widgets.message_list import MessageList
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.prompt_input import PromptInput
from ferrum_mac.tui.widgets.status_bar import StatusBar


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
        self.conversations = Conversations(self)
        self.answers = Answers(self)
        self.composer = Composer(self)
        self.chat_settings = TurnSettings(self)
        self.figures = StatusFigures(self)

    @property
    def history(self):
        return self.app.history

    @property
    def current_id(self) -> int | None:
        """The conversation shown (None: a new chat, not saved until its first message)."""
        return self.conversations.current_id

    @property
    def answer(self) -> MessageView | None:
        """The answer being streamed."""
        return self.answers.view

    @property
    def busy(self) -> bool:
        return self.answers.busy

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
        await self.conversations.open(first)
        self.query_one(PromptInput).focus()

    def refresh_status(self) -> None:
        self.figures.refresh()

    def refuse_while_busy(self) -> bool:
        if self.busy:
            self.notify("Still answering; Esc stops the answer first.", severity="warning")
        return self.busy

    async def focus_next_message(self, view: MessageView, step: int) -> None:
        """Focus the message `step` places from `view` (a MessageView's up and down keys)."""
        await self.conversations.focus_next_message(view, step)

    def copy(self, text: str, what: str) -> None:
        from ferrum_mac.tui.clipboard import copy_text

        self.notify(copy_text(self.app, text, what, self.app.export_dir), timeout=8)

    # -- what a turn reports ------------------------------------------------------------------

    def on_tool_calls_requested(self, event: tool_turn.ToolCallsRequested) -> None:
        self.answers.calls_requested(event.calls)

    async def on_answer_chunk(self, event: AnswerChunk) -> None:
        await self.answers.add_chunk(event)

    async def on_answer_notice(self, event: AnswerNotice) -> None:
        await self.answers.notice(event.text)

    async def on_answer_done(self, event: AnswerDone) -> None:
        await self.answers.done(event)

    async def on_answer_failed(self, event: AnswerFailed) -> None:
        await self.answers.failed(event.error)

    def on_draft_opened(self, event: DraftOpened) -> None:
        self.notify(f"Draft model {event.name} loaded: answers guess ahead with it.")

    def on_draft_failed(self, event: DraftFailed) -> None:
        self.chat_settings.draft_failed(event)

    # -- requests from widgets ----------------------------------------------------------------

    @on(PromptSubmitted)
    async def _submitted(self, event: PromptSubmitted) -> None:
        await self.composer.submit(event.text)

    @on(AttachmentsChanged)
    async def _attachments_changed(self, event: AttachmentsChanged) -> None:
        await self.composer.show_attachments(event.attachments)

    @on(EditRequested)
    def _edit(self, event: EditRequested) -> None:
        self.composer.edit(event.message_id, event.text)

    @on(ConversationChosen)
    async def _chosen(self, event: ConversationChosen) -> None:
        await self.conversations.choose(event.conversation_id)

    @on(BranchRequested)
    async def _branch(self, event: BranchRequested) -> None:
        await self.conversations.switch_branch(event.message_id, event.step)

    @on(SearchChanged)
    async def _search_changed(self, event: SearchChanged) -> None:
        await self.conversations.filter(event.text)

    @on(CopyRequested)
    def _copy(self, event: CopyRequested) -> None:
        self.copy(event.text, event.what)

    # -- actions: the key bindings, the command palette's commands ----------------------------

    def action_stop(self) -> None:
        if self.busy:
            self.answers.stop()
        else:
            self.composer.cancel_edit()

    async def action_new_chat(self) -> None:
        await self.conversations.new_chat()

    async def action_regenerate(self) -> None:
        await self.answers.regenerate()

    def action_toggle_reasoning(self) -> None:
        self.conversations.toggle_reasoning()

    def action_settings(self) -> None:
        self.chat_settings.open_dialog()

    def action_search(self) -> None:
        self.conversations.search()

    def action_attach(self) -> None:
        self.composer.ask_attachment()

    def action_toggle_list(self) -> None:
        """One key to the conversation list, and the same key back to the prompt."""
        self.conversations.toggle_list()

    def action_last_message(self) -> None:
        self.conversations.focus_last_message()

    def action_rename(self) -> None:
        self.conversations.rename()

    def action_delete_chat(self) -> None:
        self.conversations.delete()

    def action_export(self) -> None:
        self.conversations.export()

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
