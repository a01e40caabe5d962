"""What the REPL and its slash commands share: the engine, the conversation and the printer.
Its own module so that repl.py imports repl_commands.py and not the other way round."""

from __future__ import annotations

from dataclasses import dataclass

from ferrum_mac.cli.printer import EventPrinter
from ferrum_mac.engine import ChatEngine, Conversation


@dataclass
class ChatSession:
    engine: ChatEngine
    conv: Conversation
    printer: EventPrinter
