"""The line REPL of `ferrum run`, in Ollama's manner.

`>>> ` prompt; `\"\"\"` opens and closes a multi-line message; slash commands (`/?` lists
them, see cli/repl_commands.py). Ctrl-C stops the answer and returns to the prompt (a second one
during the same answer interrupts at once); at the prompt, Ctrl-C twice in a row or Ctrl-D
exits. On a terminal, lines are edited with readline and kept in a history file.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from ferrum_mac.cli.printer import EventPrinter
from ferrum_mac.cli.repl_commands import Commands
from ferrum_mac.cli.session import ChatSession
from ferrum_mac.engine import ChatEngine, Conversation
from ferrum_mac.errors import FerrumError

PROMPT, MORE = ">>> ", "... "
FENCE = '"""'
HINT = "Use Ctrl-D or /bye to exit (or Ctrl-C again)."
GREETING = "Chatting with {model}. /? for help, /bye or Ctrl-D to exit."


class LineReader:
    """Lines from a terminal (readline editing and history) or from a pipe (no prompts)."""

    def __init__(self, stream: TextIO | None = None, history: Path | None = None):
        self.stream = stream or sys.stdin
        self.tty = self.stream.isatty()
        self.history = history
        self._readline = None
        if self.tty:
            try:
                import readline
            except ImportError:  # a Python built without it: plain input() still works
                readline = None
            self._readline = readline
            if readline and history and history.is_file():
                try:
                    readline.read_history_file(str(history))
                except OSError:
                    pass

    def read(self, prompt: str) -> str:
        """One line without its newline; EOFError at the end, KeyboardInterrupt on Ctrl-C."""
        if self.tty:
            return input(prompt)
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def close(self) -> None:
        if self._readline and self.history:
            try:
                self.history.parent.mkdir(parents=True, exist_ok=True)
                self._readline.write_history_file(str(self.history))
            except OSError:
                pass


def read_message(reader: LineReader) -> str:
    """One message: a line, or the lines between a pair of triple quotes."""
    line = reader.read(PROMPT)
    if not line.lstrip().startswith(FENCE):
        return line
    body, lines = line.lstrip()[len(FENCE) :], []
    while not body.rstrip().endswith(FENCE):
        lines.append(body)
        body = reader.read(MORE)
    lines.append(body.rstrip()[: -len(FENCE)])
    return "\n".join(lines).strip("\n")  # the fences' own lines are not part of the message


class Repl:
    def __init__(self, engine: ChatEngine, conv: Conversation, printer: EventPrinter, reader: LineReader | None = None):
        printer.limit_setting = "/set num_predict"
        printer.context_advice = "/clear empties it; `ferrum run --kv-capacity N` sets its size"
        self.session = ChatSession(engine, conv, printer)
        self.reader = reader or LineReader(history=history_file())
        self.commands = Commands(self.session)

    def run(self) -> None:
        if self.reader.tty:  # a person at a terminal, not a script piping messages in
            print(GREETING.format(model=self.session.engine.name or "the model"))
        try:
            self._loop()
        except KeyboardInterrupt:  # a Ctrl-C that landed between two reads: leave, as asked
            pass
        finally:
            self.reader.close()
            if self.reader.tty:
                print()
            self.session.conv.close()

    def _loop(self) -> None:
        interrupted = False  # the last line ended in Ctrl-C
        while True:
            try:
                text = read_message(self.reader)
            except KeyboardInterrupt:
                if interrupted:
                    return
                interrupted = True
                print(f"\n{HINT}", file=sys.stderr)
                continue
            except EOFError:
                return
            interrupted = False
            if text.startswith("/") and not text.startswith("//"):
                if not self.commands.run(text):
                    return
            elif text.strip():
                self.ask(text)

    def ask(self, text: str) -> None:
        printer = self.session.printer
        try:
            with ctrl_c_cancels(self.session.engine):
                for event in self.session.conv.send(text):
                    printer.print(event)
        except KeyboardInterrupt:
            printer.end_line()
        except FerrumError as e:
            printer.end_line()
            print(f"ferrum: {e}", file=sys.stderr)


@contextmanager
def ctrl_c_cancels(engine: ChatEngine):
    """While an answer streams, the first Ctrl-C asks the engine to stop after the current
    token; a second raises KeyboardInterrupt (the engine keeps the conversation consistent)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    presses = 0

    def on_sigint(signum, frame):
        nonlocal presses
        presses += 1
        if presses > 1:
            raise KeyboardInterrupt
        engine.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def history_file() -> Path:
    from ferrum_mac.settings import repl_history_path

    return repl_history_path()
