"""The REPL as a person at a terminal meets it: a greeting naming the model and the help, and a
bare /set that lists the settings."""

from __future__ import annotations

from types import SimpleNamespace

from ferrum_mac.cli.printer import EventPrinter
from ferrum_mac.cli.repl import Repl
from ferrum_mac.cli.repl_commands import Commands
from ferrum_mac.cli.session import ChatSession


class Reader:
    def __init__(self, tty: bool):
        self.tty = tty

    def read(self, prompt: str) -> str:
        raise EOFError

    def close(self) -> None:
        pass


def repl(tty: bool) -> Repl:
    engine = SimpleNamespace(name="smollm2:135m")
    return Repl(engine, SimpleNamespace(close=lambda: None), EventPrinter(), Reader(tty))


def test_a_terminal_repl_greets_with_the_model_and_the_help(capsys):
    repl(tty=True).run()
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "Chatting with smollm2:135m. /? for help, /bye or Ctrl-D to exit."


def test_a_piped_repl_prints_no_greeting(capsys):
    repl(tty=False).run()
    assert capsys.readouterr().out == ""


def test_a_bare_set_lists_the_settings(capsys):
    session = ChatSession(SimpleNamespace(name="m"), SimpleNamespace(), EventPrinter())
    assert Commands(session).run("/set")
    out = capsys.readouterr().out
    assert "Unknown setting" not in out
    assert out.startswith("Available /set commands:") and "/set temperature" not in out
    assert "/set parameter NAME VALUE" in out and "/set format json | text" in out and "/show" not in out


def test_a_full_context_says_how_to_change_it():
    from ferrum_mac.cli.printer import cut_line
    from ferrum_mac.engine import CONTEXT, Done

    done = Done(
        CONTEXT, prompt_tokens=30, cached_tokens=0, generated_tokens=10, ttft_s=0.1, prefill_tps=1, decode_tps=1
    )
    assert cut_line(done, "--max-tokens") == (
        "the answer was cut at 10 tokens: the context is full "
        "(--kv-capacity sets its size, up to the model's context length)"
    )
    printer = repl(tty=False).session.printer
    assert cut_line(done, printer.limit_setting, printer.context_advice).endswith(
        "(/clear empties it; `ferrum run --kv-capacity N` sets its size)"
    )


def test_run_and_the_chat_app_take_the_same_context_policy():
    from typer.main import get_command

    from ferrum_mac.cli import app
    from ferrum_mac.cli.run import RunOptions
    from ferrum_mac.engine import TRUNCATE_OLDEST
    from ferrum_mac.tui.chat_settings import stored_settings

    flag = next(p for p in get_command(app).commands["run"].params if p.name == "context")
    assert RunOptions().context == flag.default == stored_settings()["context_policy"] == TRUNCATE_OLDEST
