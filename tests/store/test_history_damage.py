"""A chat history row damaged outside ferrum (by hand, or by another program) costs that row's
settings or figures, never the conversation: a real sqlite file, written by ferrum, then edited."""

from __future__ import annotations

import sqlite3

from ferrum_mac.store.history import History


def test_damaged_settings_and_stats_columns_load_as_empty(tmp_path):
    path = tmp_path / "history.db"
    history = History.open(path)
    conv = history.new_conversation("kept", {"temperature": 0.3})
    history.add_message(conv.id, "user", "hello", stats={"tokens": 3})
    history.close()

    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE conversations SET settings = ?", ("{not json",))
        db.execute("UPDATE messages SET stats = ?", ("[1, 2]",))
    db.close()

    history = History.open(path)
    [loaded] = history.conversations()
    assert (loaded.title, loaded.settings) == ("kept", {})
    assert history.conversation(conv.id).settings == {}
    [message] = history.messages(conv.id)
    assert (message.content, message.stats) == ("hello", {})
    history.close()
