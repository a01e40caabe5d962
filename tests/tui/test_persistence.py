"""The history survives a killed process, and an older database migrates when opened."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tui_pilot import SIZE, ready
from ferrum_mac.errors import FerrumError
from ferrum_mac.store.history import MIGRATIONS, SCHEMA_VERSION, History
from ferrum_mac.tui.app import ChatApp
from ferrum_mac.tui.widgets.message_view import MessageView
from tui_fakes import FakeEngine, FakeServices

HERE = Path(__file__).parent

KILLED_APP = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, {here!r})
    from tui_pilot import ready, send, wait_for
    from ferrum_mac.store.history import History
    from ferrum_mac.tui.app import ChatApp
    from tui_fakes import FakeEngine, FakeServices

    async def main():
        engine = FakeEngine([[("text", "The first answer.")], [("text", "Half of the second"), ("hang",)]])
        app = ChatApp(FakeServices(engine), History.open({db!r}), engine.name)
        async with app.run_test() as pilot:
            await ready(pilot)
            await send(pilot, "first question")
            app.chat.query_one("#prompt").text = "second question"
            await pilot.press("enter")
            await wait_for(pilot, lambda: "second" in (app.chat.answer.content if app.chat.answer else ""))
            print("READY", flush=True)
            await asyncio.sleep(60)

    asyncio.run(main())
""")


def shown(app) -> list[tuple[str, str]]:
    return [(v.role, v.content) for v in app.chat.query(MessageView)]


async def test_a_process_killed_mid_answer_keeps_what_it_saved(tmp_path):
    db = tmp_path / "history.sqlite3"
    script = tmp_path / "killed_app.py"
    script.write_text(KILLED_APP.format(here=str(HERE), db=str(db)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    history = History.open(db)
    try:
        engine = FakeEngine()
        app = ChatApp(FakeServices(engine), history, engine.name)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert [c.title for c in history.conversations()] == ["first question"]
            assert len(app.chat.query_one("#conversations").children) == 1
            assert shown(app) == [
                ("user", "first question"),
                ("assistant", "The first answer."),
                ("user", "second question"),
            ]
    finally:
        history.close()


def test_an_older_schema_migrates(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + "PRAGMA user_version = 1;")
    db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (1, 'Old chat', 1.0, 2.0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'hello', 1.0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'assistant', 'hi', 1.5)")
    db.commit()
    db.close()

    history = History.open(path)
    try:
        assert history.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        chat = history.conversations()[0]
        assert (chat.title, chat.settings) == ("Old chat", {})
        assert [(m.role, m.content, m.reasoning, m.stats) for m in history.messages(1)] == [
            ("user", "hello", "", {}),
            ("assistant", "hi", "", {}),
        ]
        history.add_message(1, "assistant", "more", reasoning="thought", stats={"decode_tps": 1.0})
        assert history.messages(1)[-1].reasoning == "thought"
        assert history.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        history.close()


def test_a_newer_schema_is_refused_in_one_line(tmp_path):
    path = tmp_path / "new.sqlite3"
    History.open(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(FerrumError, match="newer than this ferrum") as e:
        History.open(path)
    assert "\n" not in str(e.value)


def test_search_rename_delete_in_the_store(history):
    a = history.new_conversation("Cats")
    b = history.new_conversation("Dogs")
    history.add_message(a.id, "user", "whiskers and purring")
    assert [c.id for c in history.conversations("purr")] == [a.id]
    history.rename(b.id, "Puppies")
    assert history.conversation(b.id).title == "Puppies"
    history.delete(a.id)
    assert [c.id for c in history.conversations()] == [b.id]
    assert history.messages(a.id) == []
