"""The app's own messages: what a turn reports from its worker thread, and what widgets ask for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.message import Message

if TYPE_CHECKING:
    from ferrum_mac.engine import ChatEngine


class PromptSubmitted(Message):
    """The person pressed Enter in the prompt."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


class AttachmentsChanged(Message):
    """The prompt's attachments changed (a file attached, a large paste, one dropped)."""

    def __init__(self, attachments: list):
        super().__init__()
        self.attachments = attachments


class AnswerChunk(Message):
    """A batch of answer and reasoning text (at most ~20 a second), with the pieces streamed so far
    (a piece is a token's text, near enough) and their rate."""

    def __init__(self, text: str, reasoning: str, pieces: int = 0, pieces_per_second: float = 0.0):
        super().__init__()
        self.text = text
        self.reasoning = reasoning
        self.pieces = pieces
        self.pieces_per_second = pieces_per_second


class AnswerNotice(Message):
    """Something the engine said about the turn (e.g. old turns were dropped to fit the context)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


class AnswerDone(Message):
    """The answer ended (finished, stopped or cut off); `stats` are the engine's figures."""

    def __init__(self, content: str, reasoning: str, stats: dict, context_used: int):
        super().__init__()
        self.content = content
        self.reasoning = reasoning
        self.stats = stats
        self.context_used = context_used


class AnswerFailed(Message):
    """The turn raised; `error` is a one-line message."""

    def __init__(self, error: str):
        super().__init__()
        self.error = error


class ConversationChosen(Message):
    def __init__(self, conversation_id: int):
        super().__init__()
        self.conversation_id = conversation_id


class SearchChanged(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class CopyRequested(Message):
    def __init__(self, text: str, what: str):
        super().__init__()
        self.text = text
        self.what = what


class EditRequested(Message):
    """Edit and resend the user message `message_id`."""

    def __init__(self, message_id: int, text: str):
        super().__init__()
        self.message_id = message_id
        self.text = text


class BranchRequested(Message):
    """Show the sibling `step` places from message `message_id` (-1: the one before)."""

    def __init__(self, message_id: int, step: int):
        super().__init__()
        self.message_id = message_id
        self.step = step


class PullProgressed(Message):
    def __init__(self, done: int, total: int, note: str = ""):
        super().__init__()
        self.done = done
        self.total = total
        self.note = note


class PullFinished(Message):
    def __init__(self, name: str, error: str = ""):
        super().__init__()
        self.name = name
        self.error = error


class EngineOpened(Message):
    def __init__(self, engine: ChatEngine, device: str, notice: str = ""):
        super().__init__()
        self.engine = engine
        self.device = device
        self.notice = notice  # a line to show once it is open (the demo model's)


class EngineFailed(Message):
    def __init__(self, name: str, error: str):
        super().__init__()
        self.name = name
        self.error = error


class DraftOpened(Message):
    """The draft model `name` is loaded beside the chat's model."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name


class DraftFailed(Message):
    """The draft model `name`, named by chat `chat_id`'s settings (None: the next new chat's),
    could not be loaded or does not match the chat's model; `error` is one line."""

    def __init__(self, name: str, chat_id: int | None, error: str):
        super().__init__()
        self.name = name
        self.chat_id = chat_id
        self.error = error
